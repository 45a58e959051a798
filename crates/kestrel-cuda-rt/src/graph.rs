//! Command lists captured as CUDA graphs.
//!
//! Capture builds the graph node by node: one kernel node per dispatch (a cuBLAS product becomes
//! a child graph captured from a stream), with an edge from every
//! earlier dispatch it conflicts with (read-after-write, write-after-read, write-after-write on
//! overlapping bytes of one allocation), transitively reduced by [`DepGraph::infer`]. Dispatches
//! with no path between them are parallel branches and may run concurrently. An edge from a
//! kernel into a dispatch marked programmatic is a programmatic edge: the dependent launches as
//! soon as every block of its predecessor has called `pdl_trigger()` (or exited) and waits for
//! the predecessor's results itself (`pdl_wait()`), so launch latency and the dependent's
//! prologue overlap the predecessor's tail. Replays of a list
//! whose kernels and edges are unchanged update the instantiated graph in place
//! (`cuGraphExecKernelNodeSetParams`) instead of instantiating it again.

use crate::access::DepGraph;
use cudarc::driver::sys;

use crate::command::{Command, CommandList, Dispatch, Gemm};
use crate::device::Device;
use crate::error::{is_sticky, CudaError, Result};
use crate::stream::Stream;

/// What [`Graph::update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphUpdate {
    /// Nothing differed.
    Unchanged,
    /// Same kernels and edges: `nodes` kernel nodes got new arguments or launch shapes in place.
    Updated { nodes: usize },
    /// Kernels or edges changed: the graph was built and instantiated again.
    Rebuilt,
}

/// An instantiated CUDA graph plus the IR it was built from.
pub struct Graph {
    device: Device,
    label: String,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: Vec<sys::CUgraphNode>,
    /// The commands as currently instantiated; they also keep their buffers allocated.
    commands: Vec<Command>,
    deps: DepGraph,
}

// SAFETY: the graph and exec handles are only used with the device's context bound, and the
// driver's graph-exec calls are thread-safe for distinct execs; `&mut self` guards updates.
unsafe impl Send for Graph {}
unsafe impl Sync for Graph {}

fn node_params(d: &Dispatch, ptrs: &mut [*mut std::ffi::c_void]) -> sys::CUDA_KERNEL_NODE_PARAMS {
    sys::CUDA_KERNEL_NODE_PARAMS {
        func: d.kernel.cu_function(),
        gridDimX: d.grid.0,
        gridDimY: d.grid.1,
        gridDimZ: d.grid.2,
        blockDimX: d.block.0,
        blockDimY: d.block.1,
        blockDimZ: d.block.2,
        sharedMemBytes: d.shared_mem,
        kernelParams: ptrs.as_mut_ptr(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    }
}

fn infer(list: &CommandList) -> DepGraph {
    let accesses: Vec<_> = list.commands().iter().map(Command::accesses).collect();
    DepGraph::infer(&accesses)
}

/// Captures the cuBLAS call of `g` straight into `graph` after `preds` (stream capture into an
/// existing graph), and returns one empty node that follows everything the call added, so the
/// product is a single node for the dependency edges.
fn capture_gemm(
    device: &Device,
    graph: sys::CUgraph,
    preds: &[sys::CUgraphNode],
    g: &Gemm,
) -> Result<sys::CUgraphNode> {
    // The process's turn at cuBLAS and the capture stream, held to the end of the capture:
    // another thread's product or capture meanwhile would break ours.
    let turn = crate::blas::calls();
    // Creating the handle allocates its workspace, which must not happen while capturing.
    device.with_blas_in_turn(&turn, |_| Ok(()))?;
    let stream = device.capture_stream();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a live stream and graph of this context; `preds` are nodes of `graph`; no edge data.
    unsafe {
        sys::cuStreamBeginCaptureToGraph(
            stream.cu(),
            graph,
            preds.as_ptr(),
            std::ptr::null(),
            preds.len(),
            mode,
        )
        .result()
    }
    .map_err(CudaError::driver("cuStreamBeginCaptureToGraph"))?;
    // SAFETY: the command holds the three buffers, sized by the encoder for m, n, k; cuBLAS has
    // a fixed workspace, so it allocates nothing during capture.
    let called = device.with_blas_in_turn(&turn, |blas| unsafe { blas.gemm_bf16(stream.cu(), g) });
    // The capture's current leaves: what the product's node must follow.
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut captured, mut leaves, mut edges, mut n): (
        u64,
        sys::CUgraph,
        *const sys::CUgraphNode,
        *const sys::CUgraphEdgeData,
        usize,
    ) = (0, std::ptr::null_mut(), std::ptr::null(), std::ptr::null(), 0);
    // SAFETY: valid out-pointers; the leaves array lives until the capture ends, and is copied
    // before that.
    let info = unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream.cu(),
            &mut status,
            &mut id,
            &mut captured,
            &mut leaves,
            &mut edges,
            &mut n,
        )
        .result()
    };
    let leaves: Vec<sys::CUgraphNode> = if info.is_ok() && !leaves.is_null() {
        // SAFETY: the driver returned `n` nodes at `leaves`.
        unsafe { std::slice::from_raw_parts(leaves, n) }.to_vec()
    } else {
        Vec::new()
    };
    let mut ended: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above, whatever the call did, so the stream is usable again.
    let end = unsafe { sys::cuStreamEndCapture(stream.cu(), &mut ended).result() };
    called?;
    info.map_err(CudaError::driver("cuStreamGetCaptureInfo"))?;
    end.map_err(CudaError::driver("cuStreamEndCapture"))?;
    let mut node: sys::CUgraphNode = std::ptr::null_mut();
    // SAFETY: `leaves` are nodes of `graph` (or `preds` when the call added nothing).
    let after = if leaves.is_empty() { preds } else { &leaves };
    unsafe { sys::cuGraphAddEmptyNode(&mut node, graph, after.as_ptr(), after.len()).result() }
        .map_err(CudaError::driver("cuGraphAddEmptyNode"))?;
    Ok(node)
}

impl Device {
    /// Captures `list` into a CUDA graph whose edges are inferred from the dispatches' buffer
    /// accesses. See [`Graph`].
    pub fn capture(&self, list: &CommandList) -> Result<Graph> {
        Graph::build(self, list)
    }
}

impl Graph {
    pub(crate) fn build(device: &Device, list: &CommandList) -> Result<Graph> {
        let deps = infer(list);
        Graph::instantiate(device, list, deps)
    }

    fn instantiate(device: &Device, list: &CommandList, deps: DepGraph) -> Result<Graph> {
        device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags must be 0.
        unsafe { sys::cuGraphCreate(&mut graph, 0).result() }.map_err(CudaError::driver("cuGraphCreate"))?;
        // From here on `g` owns the handles, so every early return destroys them.
        let mut g = Graph {
            device: device.clone(),
            label: list.label().to_string(),
            graph,
            exec: std::ptr::null_mut(),
            nodes: Vec::with_capacity(list.len()),
            commands: list.commands().to_vec(),
            deps,
        };
        let mut programmatic_edges = 0;
        for (j, command) in list.commands().iter().enumerate() {
            // A programmatic dispatch waits for kernel predecessors itself (pdl_wait); every
            // other edge is an ordinary completion edge.
            let is_programmatic = |p: usize| match (command, &list.commands()[p]) {
                (Command::Launch(d), Command::Launch(_)) => d.programmatic && device.pdl(),
                _ => false,
            };
            let (early, preds): (Vec<usize>, Vec<usize>) =
                g.deps.preds(j).iter().partition(|&&p| is_programmatic(p));
            let preds: Vec<sys::CUgraphNode> = preds.iter().map(|&p| g.nodes[p]).collect();
            let mut node: sys::CUgraphNode = std::ptr::null_mut();
            match command {
                Command::Launch(d) => {
                    d.kernel.ensure_shared_mem(d.shared_mem)?;
                    let mut params = d.params();
                    let mut ptrs = params.pointers();
                    let np = node_params(d, &mut ptrs);
                    // SAFETY: `preds` are nodes of this graph; `np` points to one word per kernel
                    // parameter, which the driver copies when the node is created.
                    unsafe {
                        sys::cuGraphAddKernelNode_v2(&mut node, g.graph, preds.as_ptr(), preds.len(), &np)
                            .result()
                    }
                    .map_err(|source| CudaError::Launch {
                        submission: g.label.clone(),
                        dispatch: d.label.clone(),
                        kernel: d.kernel.name().to_string(),
                        detail: format!("{}; {} graph predecessors", d.describe_launch(), preds.len()),
                        source,
                    })?;
                }
                Command::Gemm(gemm) => node = capture_gemm(device, g.graph, &preds, gemm)?,
            }
            for &p in &early {
                let edge = sys::CUgraphEdgeData {
                    from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                    to_port: 0,
                    type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
                    reserved: [0; 5],
                };
                // SAFETY: both nodes are kernel nodes of this graph; one edge, described by `edge`.
                unsafe { sys::cuGraphAddDependencies_v2(g.graph, &g.nodes[p], &node, &edge, 1).result() }
                    .map_err(CudaError::driver("cuGraphAddDependencies"))?;
            }
            programmatic_edges += early.len() as u64;
            g.nodes.push(node);
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a complete graph; valid out-pointer.
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, g.graph, 0).result() }
            .map_err(CudaError::driver("cuGraphInstantiateWithFlags"))?;
        g.exec = exec;
        let counters = device.counters_ref();
        counters.add_graph_instantiations(1);
        counters.add_graph_nodes(g.nodes.len() as u64);
        counters.add_graph_edges(g.deps.edges().len() as u64);
        counters.add_graph_programmatic_edges(programmatic_edges);
        Ok(g)
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn deps(&self) -> &DepGraph {
        &self.deps
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn edge_count(&self) -> usize {
        self.deps.edges().len()
    }

    /// Replays the graph on the device's compute stream.
    pub fn launch(&self) -> Result<()> {
        self.launch_on(self.device.compute())
    }

    /// Replays the graph on `stream`. Asynchronous: errors raised by the kernels surface at the
    /// next synchronisation, labelled with this graph's label.
    pub fn launch_on(&self, stream: &Stream) -> Result<()> {
        self.device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let timing = if self.device.is_profiling() {
            Some(stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
        } else {
            None
        };
        // SAFETY: an instantiated exec of this context; the buffers it names are kept alive by
        // `self.commands`.
        unsafe { sys::cuGraphLaunch(self.exec, stream.cu()).result() }.map_err(|e| {
            if is_sticky(&e) {
                stream.map_err("cuGraphLaunch")(e)
            } else {
                CudaError::Submission {
                    submission: self.label.clone(),
                    source: e,
                }
            }
        })?;
        if let Some(start) = timing {
            let end = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            self.device.push_profile_span(
                self.label.clone(),
                format!("graph[{} nodes]", self.nodes.len()),
                start,
                end,
            );
        }
        let counters = self.device.counters_ref();
        counters.add_graph_launches(1);
        counters.add_dispatches(self.nodes.len() as u64);
        stream.end_submission(&self.label)
    }

    /// Makes the graph run `list` from now on. When `list` has the same kernels in the same
    /// order and the same inferred edges, only the changed nodes are updated in the
    /// instantiated graph; otherwise the graph is rebuilt. Updates are ordered after launches
    /// already submitted.
    pub fn update(&mut self, list: &CommandList) -> Result<GraphUpdate> {
        let deps = infer(list);
        let same_topology = list.len() == self.commands.len()
            && deps == self.deps
            && list
                .commands()
                .iter()
                .zip(&self.commands)
                .all(|(a, b)| match (a, b) {
                    (Command::Launch(a), Command::Launch(b)) => a.same_kernel(b),
                    // A changed product is captured again: rebuild.
                    (Command::Gemm(a), Command::Gemm(b)) => {
                        (a.m, a.n, a.k, a.ptrs()) == (b.m, b.n, b.k, b.ptrs())
                    }
                    _ => false,
                });
        if !same_topology {
            *self = Graph::instantiate(&self.device, list, deps)?;
            return Ok(GraphUpdate::Rebuilt);
        }
        self.device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let mut changed = 0;
        for (j, command) in list.commands().iter().enumerate() {
            let (Command::Launch(d), Command::Launch(old)) = (command, &self.commands[j]) else {
                continue;
            };
            if !d.launch_differs(old) {
                continue;
            }
            d.kernel.ensure_shared_mem(d.shared_mem)?;
            let mut params = d.params();
            let mut ptrs = params.pointers();
            let np = node_params(d, &mut ptrs);
            // SAFETY: `nodes[j]` belongs to the graph `exec` was instantiated from and runs the
            // same function; the driver copies the parameters.
            unsafe { sys::cuGraphExecKernelNodeSetParams_v2(self.exec, self.nodes[j], &np).result() }
                .map_err(CudaError::driver("cuGraphExecKernelNodeSetParams"))?;
            self.commands[j] = command.clone();
            changed += 1;
        }
        self.label = list.label().to_string();
        if changed == 0 {
            return Ok(GraphUpdate::Unchanged);
        }
        self.device.counters_ref().add_graph_updates(1);
        Ok(GraphUpdate::Updated { nodes: changed })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let ctx = self.device.context();
        ctx.record_err(ctx.bind_to_thread());
        // SAFETY: handles created by this value and destroyed once; the driver defers freeing
        // an exec until launches already submitted have completed.
        unsafe {
            if !self.exec.is_null() {
                ctx.record_err(sys::cuGraphExecDestroy(self.exec).result());
            }
            if !self.graph.is_null() {
                ctx.record_err(sys::cuGraphDestroy(self.graph).result());
            }
        }
    }
}
