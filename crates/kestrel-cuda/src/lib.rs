//! Kestrel's CUDA backend: [`CudaBackend`] prepares an op graph on a [`Device`] (one arena laid
//! out by the shared plan, weights and states by label), encodes every node into dispatches of
//! the embedded kernels (`ops/<family>.rs` beside `kernels/<family>.cu`, through the
//! [`Encoder`]), and runs the program eagerly or replays it as one CUDA graph.
//!
//! Imports go one way: `backend.rs` → `encoder.rs` and `ops/`; `ops/*` → `encoder.rs`; all of it
//! on the runtime crate `kestrel-cuda-rt`, whose public types are re-exported here so callers
//! need one crate.

pub mod backend;
pub mod encoder;
pub mod ops;

pub use backend::{projection_copy_bytes, CudaBackend, CudaProgram, RunMode};
pub use encoder::{Encoder, Exact};
pub use kestrel_cuda_rt::{
    ceilings, device_count, driver_present, Arg, Buffer, Ceilings, CommandList, CounterSnapshot, CudaError,
    Device, DeviceInfo, Dim3, Dispatch, DispatchBuilder, Graph, GraphUpdate, Kernel, KernelRegistry,
    LoadOrigin, ModuleSource, PinnedBuffer, Profile, Result, Scalar, StageFence, Stream, Timer, TimingStat,
    PDL_HEADER, RUNTIME_MODULE,
};
pub use ops::MODULES;
