// Programmatic dependent launch (sm_90), given to modules as the in-memory header "pdl.cuh":
// the primitives a kernel recorded as programmatic uses, and their contract.
#pragma once

// A dispatch recorded as programmatic may be launched by a CUDA graph before the kernels it
// depends on have finished. Its contract: every block calls pdl_wait() before it reads anything
// an earlier kernel writes and before it writes anything, and calls pdl_trigger(), which lets the
// next kernel launch, only after its wait. So before the wait a kernel may read only what no
// kernel of the run writes: weights, the run's inputs (token ids, positions and sequences,
// uploaded before it), and the rows of a KV cache before the run's first position of each
// sequence (written by earlier runs: a sequence's several tokens in one run write theirs); or
// what a kernel wrote that the kernels it follows depend on themselves (graphs are transitively
// reduced, so that kernel is not among its predecessors: it finished before they passed their
// waits and let this one launch). Because each
// wait follows the previous kernel's completion, the completion of a kernel still implies the
// completion of everything before it. Without a pending programmatic launch both return at once.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The one exception: a block with nothing to do in this run (it has read only the run's inputs,
// and writes nothing) may leave without waiting, so that it does not hold a multiprocessor while
// the kernel before it still runs, provided another block of its grid always waits: the grid then
// still completes after that wait, and its own trigger still follows it. Written as
// `if (idle) PDL_LEAVE_IDLE;` where the kernel's comment says which block always waits; the
// contract test (kestrel-cuda's pdl_contract.rs) lists the functions allowed to.
#define PDL_LEAVE_IDLE return
// The contract at its simplest, as a kernel's first statement: wait, then let the next kernel
// launch. Kernels with work that needs nothing from earlier kernels (loading weights) do that
// work first and call the two themselves.
__device__ __forceinline__ void pdl_begin() {
    pdl_wait();
    pdl_trigger();
}
