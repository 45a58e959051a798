//! The CUDA backend: runs op graphs on a [`Device`], each node encoded into dispatches of the
//! embedded kernels, the whole program run eagerly or replayed as one CUDA graph.
//!
//! Memory follows the shared [`Plan`]: one arena allocation per program with a view per
//! transient, dedicated allocations for inputs and outputs, and weights and states allocated once
//! per label and shared between programs (host weights in mapped page-locked host memory).
//! Scratch memory the op encoders ask for comes from one region the backend keeps for all its
//! programs: every node starts again at its first byte, so the region is as large as the
//! largest node's need, and the dispatches of nodes that reuse the same bytes are ordered by the
//! byte-range dependency analysis like any other writers. The bf16 copies of the projections
//! that products of many tokens dequantise are kept for all programs too, by the weight's label:
//! made when a program first needs one, filled before the next run and again after any write to
//! the weight.

use std::collections::HashMap;

use kestrel_core::ir::{Buf, BufKind, Graph, LinearWeight, Op};
use kestrel_core::planner::{Plan, Slot};
use kestrel_core::{Backend, CoreError, DType};

use kestrel_cuda_rt::{Buffer, CommandList, CudaError, Device, Graph as CudaGraph, PinnedBuffer, Result};

use crate::encoder::{Copies, Encoder, Exact, Scratch};
use crate::ops;

/// How programs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    /// One launch per dispatch on the compute stream.
    Eager,
    /// The program is captured once as a CUDA graph and replayed.
    Graph,
}

pub struct CudaBackend {
    device: Device,
    mode: RunMode,
    /// Fast paths switched off.
    exact: Exact,
    persistent: HashMap<String, (String, Buffer)>,
    scratch: Scratch,
    /// bf16 copies of the projections products of many tokens dequantise (None: none kept; they
    /// are dequantised into scratch memory at every run). Boxed: the backend stays small beside
    /// the CPU's in the engine's sessions.
    copies: Option<Box<Copies>>,
}

/// A graph prepared for CUDA.
pub struct CudaProgram {
    graph: Graph,
    plan: Plan,
    /// The buffer behind each graph buffer (None: unused).
    views: Vec<Option<Buffer>>,
    arena: Option<Buffer>,
    list: CommandList,
    exec: Option<CudaGraph>,
}

impl CudaProgram {
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn commands(&self) -> &CommandList {
        &self.list
    }

    /// The device buffer behind a graph buffer.
    pub fn buffer(&self, b: impl Into<Buf>) -> Option<&Buffer> {
        self.views[b.into().index()].as_ref()
    }
}

/// Bytes the bf16 copies of `graph`'s projections take once its products of at least
/// `dequant_from` tokens have run (0: never dequantised): every quantised product but router
/// logits whose weight the dequantised path takes, each weight counted once. What a backend
/// keeping copies holds beside the weights, for a budget to count (a weight whose buffers are
/// not aligned for the path makes no copy, so this is an upper bound).
pub fn projection_copy_bytes(graph: &Graph, dequant_from: usize) -> u64 {
    if dequant_from == 0 {
        return 0;
    }
    let decisions = decision_inputs(graph);
    let mut seen = std::collections::HashSet::new();
    let mut bytes = 0;
    for (node, decision) in graph.nodes.iter().zip(decisions) {
        if let Op::Linear {
            w: ref w @ LinearWeight::Quant { ref format, .. },
            in_dim,
            out_dim,
            ..
        } = node.op
        {
            let copied = !decision && ops::dequant_format_fits(format, (in_dim, out_dim));
            if copied && seen.insert(w.bufs()[0]) {
                bytes += (in_dim * out_dim * DType::BF16.size_in_bytes()) as u64;
            }
        }
    }
    bytes
}

/// Nodes whose output a router reads: their logits pick experts, so they are computed exactly.
fn decision_inputs(graph: &Graph) -> Vec<bool> {
    let mut precise = vec![false; graph.nodes.len()];
    for (i, node) in graph.nodes.iter().enumerate() {
        if let kestrel_core::ir::Op::Router { logits, .. } = node.op {
            if let Some(j) = (0..i).rev().find(|&j| graph.nodes[j].op.io().1.contains(&logits)) {
                precise[j] = true;
            }
        }
    }
    precise
}

/// `len` bytes of `buf`'s storage from byte `offset` (None: the buffer has none here).
fn byte_view(p: &CudaProgram, buf: Buf, offset: usize, len: usize) -> Result<Option<Buffer>> {
    let Some(b) = p.buffer(buf) else { return Ok(None) };
    let view = b.bytes().view(offset, DType::U8, len).map_err(|_| {
        CudaError::Config(CoreError::OutOfBounds {
            label: p.graph.decl(buf).label.clone(),
            offset,
            len,
            capacity: b.byte_len(),
        })
    })?;
    Ok(Some(view))
}

fn signature(d: &kestrel_core::ir::BufDecl) -> String {
    format!("{} {:?}", d.dtype, d.shape)
}

impl CudaBackend {
    pub fn new(device: Device, mode: RunMode) -> Self {
        CudaBackend {
            mode,
            exact: Exact::default(),
            persistent: HashMap::new(),
            scratch: Scratch::default(),
            copies: device.projection_copies().then(Box::default),
            device,
        }
    }

    /// Whether the backend keeps bf16 copies of the projections that products of many tokens
    /// dequantise (by default as `Config::projection_copies` says; never where that is off).
    /// Set before the first program.
    pub fn with_projection_copies(mut self, keep: bool) -> Self {
        self.copies = (keep && self.device.projection_copies()).then(Box::default);
        self
    }

    /// Bytes the bf16 copies of projections take now.
    pub fn projection_copy_bytes(&self) -> usize {
        self.copies.as_ref().map_or(0, |c| c.bytes())
    }

    /// `buf` of `p` is being written: a weight's copy goes stale.
    fn written(&mut self, p: &CudaProgram, buf: Buf) {
        if let Some(copies) = &mut self.copies {
            let d = p.graph.decl(buf);
            if d.kind == BufKind::Weight {
                copies.written(&d.label);
            }
        }
    }

    /// Programs prepared from now on leave out the fast paths `exact` names.
    pub fn with_exact(mut self, exact: Exact) -> Self {
        self.exact = exact;
        self
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// How programs run from now on. Programs prepared in graph mode keep their captured graph
    /// and run eagerly while the mode is `Eager` (so each dispatch can be timed, see
    /// [`Device::set_profiling`]); programs prepared eagerly have no graph and stay eager.
    pub fn set_mode(&mut self, mode: RunMode) {
        self.mode = mode;
    }

    /// Fills the arena and every dedicated buffer except inputs with 0xFF bytes (NaN as f32),
    /// so a kernel that leaves an output unwritten is caught.
    pub fn poison(&mut self, p: &CudaProgram) -> Result<()> {
        let s = self.device.compute();
        if let Some(a) = &p.arena {
            s.fill(a, 0xFF)?;
        }
        for (i, d) in p.graph.bufs.iter().enumerate() {
            if d.kind == BufKind::Output {
                if let Some(b) = &p.views[i] {
                    s.fill(b, 0xFF)?;
                }
            }
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Program = CudaProgram;
    type Error = CudaError;
    type HostBuffer = PinnedBuffer<u8>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn is_out_of_memory(err: &CudaError) -> bool {
        err.is_out_of_memory()
    }

    /// bf16 from the token count where products run on tensor cores over bf16 activations
    /// (f32 when those are switched off, [`Exact::projections`]).
    fn projection_input_dtype(&self, tokens: usize) -> DType {
        if tokens >= ops::GEMM_MIN_TOKENS && !self.exact.projections {
            DType::BF16
        } else {
            DType::F32
        }
    }

    fn prepare(&mut self, graph: &Graph) -> Result<CudaProgram> {
        let plan = Plan::new(graph);
        let arena = if plan.arena_bytes > 0 {
            Some(self.device.alloc(DType::U8, plan.arena_bytes)?)
        } else {
            None
        };
        let mut views = Vec::with_capacity(graph.bufs.len());
        for (i, d) in graph.bufs.iter().enumerate() {
            let view = match plan.slots[i] {
                Slot::Persistent => {
                    let sig = signature(d);
                    match self.persistent.get(&d.label) {
                        Some((old, _)) if *old != sig => {
                            return Err(CudaError::PersistentMismatch {
                                label: d.label.clone(),
                                old: old.clone(),
                                new: sig,
                            })
                        }
                        Some((_, b)) => Some(b.clone()),
                        None => {
                            let b = if d.kind == BufKind::HostWeight {
                                Buffer::mapped_host(self.device.pinned::<u8>(d.byte_len())?)?
                            } else {
                                self.device.alloc(d.dtype, d.shape.clone())?
                            };
                            self.persistent.insert(d.label.clone(), (sig, b.clone()));
                            Some(b)
                        }
                    }
                }
                Slot::Dedicated => Some(self.device.alloc(d.dtype, d.shape.clone())?),
                Slot::Arena { offset } => {
                    Some(arena.as_ref().expect("arena exists when slots use it").view(
                        offset,
                        d.dtype,
                        d.shape.clone(),
                    )?)
                }
                Slot::Unused => None,
            };
            views.push(view);
        }
        let mut list = CommandList::new("forward");
        let precise = decision_inputs(graph);
        let mut enc = Encoder::new(
            &self.device,
            graph,
            &views,
            &mut list,
            &mut self.scratch,
            self.exact,
            precise.clone(),
        );
        if let Some(copies) = &mut self.copies {
            enc = enc.with_copies(copies);
        }
        let mut i = 0;
        while i < graph.nodes.len() {
            let node = &graph.nodes[i];
            enc.start_node(i);
            let before = enc.list.len();
            let named = |e| match e {
                CudaError::Op { reason, .. } => CudaError::Op {
                    node: node.label.clone(),
                    reason,
                },
                other => other,
            };
            // Nodes one kernel does together take the last one's label.
            let window: Vec<&kestrel_core::ir::Op> = graph.nodes
                [i..graph.nodes.len().min(i + ops::FUSED_MAX_NODES)]
                .iter()
                .map(|n| &n.op)
                .collect();
            let fused = ops::encode_fused(&window, &precise[i..i + window.len()], &mut enc).map_err(named)?;
            if fused > 0 {
                enc.list.relabel_from(before, &graph.nodes[i + fused - 1].label);
                i += fused;
                continue;
            }
            ops::encode(&node.op, &mut enc).map_err(named)?;
            enc.list.relabel_from(before, &node.label);
            i += 1;
        }
        let exec = match self.mode {
            RunMode::Graph if !list.is_empty() => Some(self.device.capture(&list)?),
            _ => None,
        };
        Ok(CudaProgram {
            graph: graph.clone(),
            plan,
            views,
            arena,
            list,
            exec,
        })
    }

    fn graph(program: &CudaProgram) -> &Graph {
        &program.graph
    }

    fn write_bytes(&mut self, p: &mut CudaProgram, buf: Buf, offset: usize, bytes: &[u8]) -> Result<()> {
        self.written(p, buf);
        let Some(view) = byte_view(p, buf, offset, bytes.len())? else {
            return Ok(());
        };
        self.device.compute().upload(&view, bytes)
    }

    /// A memset on the compute stream: a hybrid model's recurrent states are tens of megabytes
    /// a sequence, which a write of host zeros would bring over the link.
    fn zero_bytes(&mut self, p: &mut CudaProgram, buf: Buf, offset: usize, len: usize) -> Result<()> {
        self.written(p, buf);
        match byte_view(p, buf, offset, len)? {
            Some(view) => self.device.compute().fill(&view, 0),
            None => Ok(()),
        }
    }

    fn copy_bytes(
        &mut self,
        p: &mut CudaProgram,
        buf: Buf,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<()> {
        self.written(p, buf);
        match (byte_view(p, buf, src, len)?, byte_view(p, buf, dst, len)?) {
            (Some(from), Some(to)) => self.device.compute().copy(&to, &from),
            _ => Ok(()),
        }
    }

    /// Page-locked, so copies from it run on the copy engine at the link's speed.
    fn alloc_host(&mut self, bytes: usize) -> Result<PinnedBuffer<u8>> {
        self.device.pinned::<u8>(bytes)
    }

    fn host_bytes_mut(host: &mut PinnedBuffer<u8>) -> Result<&mut [u8]> {
        host.as_mut_slice()
    }

    fn adopt_host(&mut self, label: &str, host: PinnedBuffer<u8>) -> Result<()> {
        let b = Buffer::mapped_host(host)?;
        let sig = signature(&kestrel_core::ir::BufDecl::host_weight(label, b.byte_len()));
        self.persistent.insert(label.to_string(), (sig, b));
        Ok(())
    }

    fn write_from_host(
        &mut self,
        p: &mut CudaProgram,
        buf: Buf,
        offset: usize,
        src: &PinnedBuffer<u8>,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        self.written(p, buf);
        let Some(view) = byte_view(p, buf, offset, range.len())? else {
            return Ok(());
        };
        self.device.compute().upload_pinned_range(&view, src, range.start)
    }

    fn read_bytes(&mut self, p: &CudaProgram, buf: Buf, out: &mut [u8]) -> Result<()> {
        let Some(b) = p.buffer(buf) else { return Ok(()) };
        self.device.compute().download_into(&b.bytes(), out)
    }

    /// Fills any stale weight copy first, on the same stream.
    fn run(&mut self, p: &mut CudaProgram) -> Result<()> {
        if let Some(copies) = &mut self.copies {
            copies.refresh(&self.device)?;
        }
        match (&p.exec, self.mode) {
            (Some(g), RunMode::Graph) => g.launch(),
            _ => self.device.run(&p.list),
        }
    }
}
