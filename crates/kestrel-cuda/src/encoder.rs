//! `Encoder`, what an op's encoder sees while the backend records a program: the program's
//! buffers, the device, the command list, scratch memory that every node reuses from its first
//! byte, zeroed counters for kernels whose blocks count their arrivals, and the bf16 copies of
//! weights the backend keeps for all its programs. The backend
//! (`backend.rs`) makes one per program; the op families (`ops/*`) use it; it imports neither.

use std::collections::HashMap;

use kestrel_core::ir::{Buf, BufKind, Graph};
use kestrel_core::{DType, Shape};
use kestrel_cuda_rt::{
    Buffer, CommandList, CudaError, Device, DispatchBuilder, Kernel, ModuleSource, Result,
};

/// The fast paths that round activations, switched off: with both set, a bf16 checkpoint is
/// computed in f32 from end to end (quantised experts keep their rounded activations: bf16 in
/// grouped products, int8 in few-token ones; there is no f32 kernel for them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Exact {
    /// Products of many tokens take the f32 kernels rather than tensor cores on x rounded to
    /// bf16 (and prefill graphs keep their norm outputs in f32); one-token products of quantised
    /// weights take the f32 matvec rather than x rounded to int8.
    pub projections: bool,
    /// bf16 experts of many tokens take the f32 kernels rather than grouped tensor-core GEMMs
    /// on bf16 activations.
    pub experts: bool,
}

impl Exact {
    /// Every fast path that rounds.
    pub const ALL: Exact = Exact {
        projections: true,
        experts: true,
    };
}

/// The scratch region and how much of it the node being encoded has taken, and the counters
/// kernels that elect a last block share.
#[derive(Default)]
pub(crate) struct Scratch {
    region: Option<Buffer>,
    cursor: usize,
    counters: Option<Buffer>,
}

/// bf16 copies of quantised weights, kept for every program of a backend: a product of many
/// tokens reads its weight's copy rather than dequantising the weight into scratch memory at
/// every run. Each copy has a command list of its own that fills it from the weight; a write to
/// any of the weight's buffers marks the copy stale, and the backend fills stale copies on the
/// compute stream before its next run.
#[derive(Default)]
pub(crate) struct Copies {
    /// By the label of the weight's first buffer.
    copies: HashMap<String, WeightCopy>,
    /// The key of the copy each weight buffer (by label) fills.
    sources: HashMap<String, String>,
    /// Some copy is stale.
    stale: bool,
}

struct WeightCopy {
    buf: Buffer,
    fill: CommandList,
    fresh: bool,
}

impl Copies {
    /// The weight buffer labelled `label` was written: the copy it fills (if any) is stale.
    pub(crate) fn written(&mut self, label: &str) {
        if let Some(copy) = self.sources.get(label).and_then(|k| self.copies.get_mut(k)) {
            copy.fresh = false;
            self.stale = true;
        }
    }

    /// Fills every stale copy on `device`'s compute stream, so the runs that follow read them.
    pub(crate) fn refresh(&mut self, device: &Device) -> Result<()> {
        if !self.stale {
            return Ok(());
        }
        for copy in self.copies.values_mut().filter(|c| !c.fresh) {
            device.run(&copy.fill)?;
            copy.fresh = true;
        }
        self.stale = false;
        Ok(())
    }

    /// Bytes the copies take.
    pub(crate) fn bytes(&self) -> usize {
        self.copies.values().map(|c| c.buf.byte_len()).sum()
    }
}

/// Scratch requests start at multiples of this many bytes.
const SCRATCH_ALIGN: usize = 256;
/// A new scratch region is rounded up to a multiple of this many bytes.
const SCRATCH_GRANULE: usize = 1 << 20;

/// What op encoders see: the program's buffers, the device, the list being recorded.
pub struct Encoder<'a> {
    pub device: &'a Device,
    pub graph: &'a Graph,
    views: &'a [Option<Buffer>],
    pub list: &'a mut CommandList,
    scratch: &'a mut Scratch,
    /// The backend's weight copies (None: it keeps none).
    copies: Option<&'a mut Copies>,
    /// The node being encoded feeds a discrete choice (router logits): no approximate fast paths,
    /// so a near tie is decided as the CPU decides it.
    pub precise: bool,
    /// The fast paths the backend was told to leave out, for every node.
    pub exact: Exact,
    /// `precise` of every node, by index.
    decisions: Vec<bool>,
    /// f32 buffers whose producer stored them rounded to bf16 in their first half (a norm or
    /// decode attention whose every reader rounds its input to bf16 anyway:
    /// `linear::read_rounded_only`), by index.
    rounded: Vec<bool>,
    /// The nodes that read each buffer (`Graph::readers`), by index.
    readers: Vec<Vec<usize>>,
}

impl<'a> Encoder<'a> {
    pub(crate) fn new(
        device: &'a Device,
        graph: &'a Graph,
        views: &'a [Option<Buffer>],
        list: &'a mut CommandList,
        scratch: &'a mut Scratch,
        exact: Exact,
        decisions: Vec<bool>,
    ) -> Encoder<'a> {
        Encoder {
            device,
            graph,
            views,
            list,
            scratch,
            copies: None,
            precise: false,
            exact,
            decisions,
            rounded: vec![false; graph.bufs.len()],
            readers: graph.readers(),
        }
    }

    /// Products of many tokens read bf16 copies of their weights kept in `copies`
    /// (`Encoder::weight_copy`).
    pub(crate) fn with_copies(mut self, copies: &'a mut Copies) -> Encoder<'a> {
        self.copies = Some(copies);
        self
    }

    /// Node `node` is being encoded: its scratch starts again at the region's first byte, and
    /// `precise` says whether it feeds a discrete choice.
    pub(crate) fn start_node(&mut self, node: usize) {
        self.precise = self.decisions[node];
        self.scratch.cursor = 0;
    }

    /// Whether node `node` feeds a discrete choice (`precise` while it is encoded).
    pub fn decision(&self, node: usize) -> bool {
        self.decisions[node]
    }

    /// The nodes that read `b`, in order.
    pub fn readers(&self, b: Buf) -> &[usize] {
        &self.readers[b.index()]
    }

    /// Records that `b`, an f32 buffer, is stored rounded to bf16 (its first half, as
    /// `rounded_view` reads it): its readers take that view instead of the f32 values.
    pub(crate) fn mark_rounded(&mut self, b: Buf) {
        self.rounded[b.index()] = true;
    }

    /// The element type `b`'s values are stored in: bf16 for an f32 buffer its producer stored
    /// rounded (`mark_rounded`), else its declared type.
    pub fn held_dtype(&self, b: Buf) -> DType {
        if self.rounded[b.index()] {
            DType::BF16
        } else {
            self.dtype(b)
        }
    }

    /// `b`'s storage as bf16 of its declared shape (the first half of an f32 buffer's bytes).
    pub fn rounded_view(&self, b: Buf) -> Result<Buffer> {
        self.buf(b)?
            .view(0, DType::BF16, self.graph.decl(b).shape.clone())
    }

    /// Function `function` of `module` (an op family's `MODULE`), compiled or loaded on first use.
    pub fn kernel(&self, module: &ModuleSource, function: &str) -> Result<Kernel> {
        self.device.kernel(module, function)
    }

    /// Records a dispatch of `kernel`, marked programmatic: every kernel of the op modules keeps
    /// the programmatic-launch contract of `pdl.cuh` (`tests/pdl_contract.rs` checks the
    /// sources), so in a CUDA graph each one launches while its predecessors finish.
    pub fn dispatch(&mut self, kernel: &Kernel) -> DispatchBuilder<'_> {
        self.list.dispatch(kernel).programmatic()
    }

    pub fn buf(&self, b: Buf) -> Result<&Buffer> {
        self.views[b.index()].as_ref().ok_or_else(|| CudaError::Op {
            node: String::new(),
            reason: format!("buffer {} has no storage", self.graph.decl(b).label),
        })
    }

    pub fn dtype(&self, b: Buf) -> DType {
        self.graph.decl(b).dtype
    }

    /// `n` u32 counters that are zero whenever no kernel is running: a kernel that uses them (to
    /// find the last of its blocks to finish) leaves them at zero again. Allocated (zeroed) per
    /// backend, grown when a node asks for more, never aliased with anything else; dispatches
    /// that use them declare them written, so no two of those run at the same time.
    pub fn counters(&mut self, n: usize) -> Result<Buffer> {
        let s = &mut *self.scratch;
        match &s.counters {
            Some(c) if c.elem_count() >= n => Ok(c.clone()),
            _ => Ok(s.counters.insert(self.device.alloc(DType::U32, n)?).clone()),
        }
    }

    /// The bf16 copy (of `shape`) of the weight whose buffers are `sources`, made on first ask,
    /// with `fill` recording into the copy's own command list the dispatches that fill it from
    /// the weight (they run before the next run, and again after any write to `sources`). None
    /// when the backend keeps no copies or `sources` are not all device weights.
    pub fn weight_copy(
        &mut self,
        sources: &[Buf],
        shape: impl Into<Shape>,
        fill: impl FnOnce(&mut CommandList, &Buffer) -> Result<()>,
    ) -> Result<Option<Buffer>> {
        let graph = self.graph;
        let Some(copies) = self.copies.as_deref_mut() else {
            return Ok(None);
        };
        if sources.is_empty() || sources.iter().any(|&b| graph.decl(b).kind != BufKind::Weight) {
            return Ok(None);
        }
        let shape = shape.into();
        let key = &graph.decl(sources[0]).label;
        if let Some(copy) = copies.copies.get(key) {
            if *copy.buf.shape() != shape {
                return Err(CudaError::PersistentMismatch {
                    label: format!("{key} (bf16 copy)"),
                    old: format!("{:?}", copy.buf.shape()),
                    new: format!("{shape:?}"),
                });
            }
            return Ok(Some(copy.buf.clone()));
        }
        let buf = self.device.alloc(DType::BF16, shape)?;
        let mut list = CommandList::new(format!("{key} bf16 copy"));
        fill(&mut list, &buf)?;
        for &b in sources {
            copies.sources.insert(graph.decl(b).label.clone(), key.clone());
        }
        copies.copies.insert(
            key.clone(),
            WeightCopy {
                buf: buf.clone(),
                fill: list,
                fresh: false,
            },
        );
        copies.stale = true;
        Ok(Some(buf))
    }

    /// Scratch memory for the node being encoded, valid until its last dispatch: the next node
    /// reuses the same bytes. A request that does not fit starts a larger region (the old one
    /// stays alive as long as the dispatches that use it).
    pub fn workspace(&mut self, dtype: DType, shape: impl Into<Shape>) -> Result<Buffer> {
        let shape = shape.into();
        let bytes = (shape.elem_count() * dtype.size_in_bytes()).max(1);
        let s = &mut *self.scratch;
        let start = s.cursor.next_multiple_of(SCRATCH_ALIGN);
        let fits = s.region.as_ref().is_some_and(|r| start + bytes <= r.byte_len());
        let (region, offset) = if fits {
            (s.region.as_ref().expect("checked above"), start)
        } else {
            // Large enough for everything this node has asked for, so the next node like it fits.
            let size = (start + bytes).next_multiple_of(SCRATCH_GRANULE);
            s.cursor = 0;
            (&*s.region.insert(self.device.alloc(DType::U8, size)?), 0)
        };
        let view = region.view(offset, dtype, shape)?;
        s.cursor = offset + bytes;
        Ok(view)
    }
}
