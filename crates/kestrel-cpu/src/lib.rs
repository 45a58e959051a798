//! Kestrel's CPU backend, the oracle every other backend is checked against.
//!
//! Plain loops with f32 accumulation, shapes in comments, parallel with rayon over output rows
//! where it matters. Memory follows the same [`Plan`] as every backend: weights and states live
//! in the backend (shared by label between programs), inputs and outputs and the transient
//! arena in the program.

#![forbid(unsafe_code)]
// Index loops mirror the formulas they implement (`out[t * d + i]`); iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

pub mod ops;
mod views;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kestrel_core::ir::{Buf, BufKind, Graph};
use kestrel_core::planner::{Plan, Slot};
use kestrel_core::{Backend, CoreError};

pub use views::{Floats, Views};

#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error("persistent buffer {label} is declared as {new} here but was {old} before")]
    PersistentMismatch { label: String, old: String, new: String },
    #[error("node {node}: {reason}")]
    Op { node: String, reason: String },
    /// The host could not give the memory a buffer needs.
    #[error("out of memory: {what} needs {bytes} bytes, which the host could not give")]
    OutOfMemory { what: String, bytes: usize },
    /// A program's own buffers past the memory the backend was given for programs.
    #[error(
        "out of memory: a program's activations and buffers need {bytes} bytes beside the {held} \
         other programs hold, past the {limit} bytes given for programs"
    )]
    ProgramMemory { bytes: usize, held: usize, limit: usize },
}

pub type Result<T, E = CpuError> = std::result::Result<T, E>;

/// Zeroed bytes aligned to 8 (enough for every dtype).
#[derive(Debug, Clone)]
pub(crate) struct Storage {
    words: Vec<u64>,
    len: usize,
}

impl Storage {
    /// `len` zeroed bytes for `what`; memory the host cannot give is an error, not an abort.
    fn new(len: usize, what: &str) -> Result<Self> {
        let oom = || CpuError::OutOfMemory {
            what: what.to_string(),
            bytes: len,
        };
        let n = len.div_ceil(8);
        // Asked for once fallibly, then taken as zeroed pages (`vec!` of zeros asks the allocator
        // for zeroed memory, which large buffers get without writing a byte; this crate has no
        // `unsafe` to do both at once).
        Vec::<u64>::new().try_reserve_exact(n).map_err(|_| oom())?;
        Ok(Storage {
            words: vec![0; n],
            len,
        })
    }
    pub(crate) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

/// The CPU backend: weights and states by label.
#[derive(Debug, Default)]
pub struct CpuBackend {
    persistent: HashMap<String, (String, Storage)>,
    /// The most bytes the live programs' own buffers (arenas and dedicated buffers) may take
    /// together, as a device's memory bounds them (None: what the host gives).
    program_memory: Option<usize>,
    /// Bytes the live programs' own buffers take, given back as each drops.
    held: Arc<AtomicUsize>,
}

/// A graph prepared for the CPU: its plan, arena and dedicated buffers.
#[derive(Debug)]
pub struct CpuProgram {
    graph: Graph,
    plan: Plan,
    arena: Storage,
    dedicated: HashMap<Buf, Storage>,
    /// Its own buffers' bytes, counted in the backend's `held` while it lives.
    bytes: usize,
    held: Arc<AtomicUsize>,
}

impl Drop for CpuProgram {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl CpuProgram {
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
}

fn signature(d: &kestrel_core::ir::BufDecl) -> String {
    format!("{} {:?}", d.dtype, d.shape)
}

impl CpuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bounds the bytes the live programs' own buffers take together, as a device's memory
    /// does: preparing a program past it is `CpuError::ProgramMemory`.
    pub fn with_program_memory(mut self, bytes: usize) -> Self {
        self.program_memory = Some(bytes);
        self
    }

    /// Storage of `buf`, for reading.
    fn bytes<'a>(&'a self, p: &'a CpuProgram, buf: Buf) -> &'a [u8] {
        let d = p.graph.decl(buf);
        match p.plan.slots[buf.index()] {
            Slot::Persistent => self.persistent[&d.label].1.bytes(),
            Slot::Dedicated => p.dedicated[&buf].bytes(),
            Slot::Arena { offset } => &p.arena.bytes()[offset..offset + d.byte_len()],
            Slot::Unused => &[],
        }
    }
}

/// The bytes of `buf` in program `p` (or among the persistent buffers), and its label.
fn bytes_mut<'a>(
    persistent: &'a mut HashMap<String, (String, Storage)>,
    p: &'a mut CpuProgram,
    buf: Buf,
) -> (&'a mut [u8], String) {
    let d = p.graph.decl(buf).clone();
    let bytes: &mut [u8] = match p.plan.slots[buf.index()] {
        Slot::Persistent => persistent
            .get_mut(&d.label)
            .expect("allocated in prepare")
            .1
            .bytes_mut(),
        Slot::Dedicated => p
            .dedicated
            .get_mut(&buf)
            .expect("allocated in prepare")
            .bytes_mut(),
        Slot::Arena { offset: o } => &mut p.arena.bytes_mut()[o..o + d.byte_len()],
        Slot::Unused => &mut [],
    };
    (bytes, d.label)
}

fn out_of_bounds(label: String, offset: usize, len: usize, capacity: usize) -> CpuError {
    CoreError::OutOfBounds {
        label,
        offset,
        len,
        capacity,
    }
    .into()
}

impl Backend for CpuBackend {
    type Program = CpuProgram;
    type Error = CpuError;
    type HostBuffer = Vec<u8>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn is_out_of_memory(err: &CpuError) -> bool {
        matches!(err, CpuError::OutOfMemory { .. } | CpuError::ProgramMemory { .. })
    }

    fn prepare(&mut self, graph: &Graph) -> Result<CpuProgram> {
        let plan = Plan::new(graph);
        let mut dedicated = HashMap::new();
        for (i, d) in graph.bufs.iter().enumerate() {
            match d.kind {
                BufKind::Weight | BufKind::HostWeight | BufKind::State => {
                    let sig = signature(d);
                    match self.persistent.get(&d.label) {
                        Some((old, _)) if *old != sig => {
                            return Err(CpuError::PersistentMismatch {
                                label: d.label.clone(),
                                old: old.clone(),
                                new: sig,
                            })
                        }
                        Some(_) => {}
                        None => {
                            self.persistent
                                .insert(d.label.clone(), (sig, Storage::new(d.byte_len(), &d.label)?));
                        }
                    }
                }
                BufKind::Input | BufKind::Output => {
                    dedicated.insert(Buf(i as u32), Storage::new(d.byte_len(), &d.label)?);
                }
                BufKind::Transient => {}
            }
        }
        let bytes = plan.arena_bytes + dedicated.values().map(|s: &Storage| s.len).sum::<usize>();
        let held = self.held.load(Ordering::Relaxed);
        if let Some(limit) = self.program_memory.filter(|&limit| held + bytes > limit) {
            return Err(CpuError::ProgramMemory { bytes, held, limit });
        }
        let arena = Storage::new(plan.arena_bytes, "the activations' arena")?;
        self.held.fetch_add(bytes, Ordering::Relaxed);
        Ok(CpuProgram {
            graph: graph.clone(),
            arena,
            plan,
            dedicated,
            bytes,
            held: self.held.clone(),
        })
    }

    fn graph(program: &CpuProgram) -> &Graph {
        &program.graph
    }

    fn alloc_host(&mut self, bytes: usize) -> Result<Vec<u8>> {
        Vec::<u8>::new()
            .try_reserve_exact(bytes)
            .map_err(|_| CpuError::OutOfMemory {
                what: "a host buffer".into(),
                bytes,
            })?;
        Ok(vec![0; bytes])
    }

    fn host_bytes_mut(host: &mut Vec<u8>) -> Result<&mut [u8]> {
        Ok(host)
    }

    fn adopt_host(&mut self, label: &str, host: Vec<u8>) -> Result<()> {
        let mut storage = Storage::new(host.len(), label)?;
        storage.bytes_mut().copy_from_slice(&host);
        let sig = signature(&kestrel_core::ir::BufDecl::host_weight(label, host.len()));
        self.persistent.insert(label.to_string(), (sig, storage));
        Ok(())
    }

    fn write_from_host(
        &mut self,
        p: &mut CpuProgram,
        buf: Buf,
        offset: usize,
        src: &Vec<u8>,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let bytes = src.get(range.clone()).ok_or_else(|| CoreError::OutOfBounds {
            label: "host buffer".into(),
            offset: range.start,
            len: range.len(),
            capacity: src.len(),
        })?;
        self.write_bytes(p, buf, offset, bytes)
    }

    fn write_bytes(&mut self, p: &mut CpuProgram, buf: Buf, offset: usize, bytes: &[u8]) -> Result<()> {
        let (dst, label) = bytes_mut(&mut self.persistent, p, buf);
        if offset + bytes.len() > dst.len() {
            return Err(out_of_bounds(label, offset, bytes.len(), dst.len()));
        }
        dst[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn copy_bytes(&mut self, p: &mut CpuProgram, buf: Buf, src: usize, dst: usize, len: usize) -> Result<()> {
        let (bytes, label) = bytes_mut(&mut self.persistent, p, buf);
        if src.max(dst) + len > bytes.len() {
            return Err(out_of_bounds(label, src.max(dst), len, bytes.len()));
        }
        bytes.copy_within(src..src + len, dst);
        Ok(())
    }

    fn read_bytes(&mut self, p: &CpuProgram, buf: Buf, out: &mut [u8]) -> Result<()> {
        let src = self.bytes(p, buf);
        if out.len() > src.len() {
            let d = p.graph.decl(buf);
            return Err(CoreError::OutOfBounds {
                label: d.label.clone(),
                offset: 0,
                len: out.len(),
                capacity: src.len(),
            }
            .into());
        }
        out.copy_from_slice(&src[..out.len()]);
        Ok(())
    }

    fn run(&mut self, p: &mut CpuProgram) -> Result<()> {
        for node in &p.graph.nodes {
            let mut views = Views::for_node(
                &p.graph,
                &p.plan,
                node,
                &mut p.arena,
                &mut p.dedicated,
                &mut self.persistent,
            )?;
            ops::exec(&node.op, &mut views).map_err(|reason| CpuError::Op {
                node: node.label.clone(),
                reason,
            })?;
        }
        Ok(())
    }
}
