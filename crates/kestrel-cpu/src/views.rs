//! Typed access to the buffers one node touches, each borrowed once: read-only buffers may be
//! read any number of times, a written buffer is handed out mutably exactly once.

use std::collections::HashMap;

use half::{bf16, f16};
use kestrel_core::ir::{Buf, BufDecl, Graph, Node};
use kestrel_core::planner::{Plan, Slot};
use kestrel_core::DType;

use crate::{CpuError, Storage};

enum Access<'a> {
    Mut(&'a mut [u8]),
    Shared(&'a [u8]),
    Taken,
}

/// The buffers of one node.
pub struct Views<'a> {
    slots: HashMap<Buf, Access<'a>>,
    decls: &'a [BufDecl],
}

/// A read-only float tensor of any float dtype, read as f32.
#[derive(Clone, Copy)]
pub enum Floats<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Floats<'_> {
    pub fn len(&self) -> usize {
        match self {
            Floats::F32(s) => s.len(),
            Floats::BF16(s) => s.len(),
            Floats::F16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Floats::F32(s) => s[i],
            Floats::BF16(s) => s[i].to_f32(),
            Floats::F16(s) => s[i].to_f32(),
        }
    }

    /// `Σ_i self[start + i] * x[i]`, accumulated in f32.
    #[inline]
    pub fn dot(&self, start: usize, x: &[f32]) -> f32 {
        fn go<T: Copy>(w: &[T], x: &[f32], f: impl Fn(T) -> f32) -> f32 {
            w.iter().zip(x).map(|(&w, &x)| f(w) * x).sum()
        }
        let n = x.len();
        match self {
            Floats::F32(s) => go(&s[start..start + n], x, |v| v),
            Floats::BF16(s) => go(&s[start..start + n], x, |v| v.to_f32()),
            Floats::F16(s) => go(&s[start..start + n], x, |v| v.to_f32()),
        }
    }

    pub fn to_vec(&self, start: usize, n: usize) -> Vec<f32> {
        (start..start + n).map(|i| self.get(i)).collect()
    }
}

fn err(reason: String) -> String {
    reason
}

impl<'a> Views<'a> {
    /// Borrows every buffer `node` touches. Buffers of one node never overlap: the planner
    /// gives transients live at the same node disjoint arena ranges.
    pub(crate) fn for_node(
        graph: &'a Graph,
        plan: &Plan,
        node: &Node,
        arena: &'a mut Storage,
        dedicated: &'a mut HashMap<Buf, Storage>,
        persistent: &'a mut HashMap<String, (String, Storage)>,
    ) -> Result<Views<'a>, CpuError> {
        let (reads, writes) = node.op.io();
        let mut bufs: Vec<Buf> = reads.into_iter().chain(writes).collect();
        bufs.sort();
        bufs.dedup();
        let mut slots = HashMap::new();

        let mut ranges: Vec<(usize, usize, Buf)> = Vec::new();
        let mut labels: HashMap<&str, Buf> = HashMap::new();
        let mut own: Vec<Buf> = Vec::new();
        for &b in &bufs {
            let d = graph.decl(b);
            match plan.slots[b.index()] {
                Slot::Arena { offset } => ranges.push((offset, offset + d.byte_len(), b)),
                Slot::Persistent => {
                    labels.insert(d.label.as_str(), b);
                }
                Slot::Dedicated => own.push(b),
                Slot::Unused => {
                    slots.insert(b, Access::Mut(&mut []));
                }
            }
        }
        ranges.sort();
        let mut rest: &'a mut [u8] = arena.bytes_mut();
        let mut consumed = 0;
        for (start, end, b) in ranges {
            if start < consumed {
                return Err(CpuError::Op {
                    node: node.label.clone(),
                    reason: "planner gave overlapping buffers to one node".into(),
                });
            }
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - consumed);
            let (mine, tail) = tail.split_at_mut(end - start);
            slots.insert(b, Access::Mut(mine));
            rest = tail;
            consumed = end;
        }
        for (label, (_, storage)) in persistent.iter_mut() {
            if let Some(&b) = labels.get(label.as_str()) {
                slots.insert(b, Access::Mut(storage.bytes_mut()));
            }
        }
        for (b, storage) in dedicated.iter_mut() {
            if own.contains(b) {
                slots.insert(*b, Access::Mut(storage.bytes_mut()));
            }
        }
        Ok(Views {
            slots,
            decls: &graph.bufs,
        })
    }

    pub fn dtype(&self, b: Buf) -> DType {
        self.decls[b.index()].dtype
    }

    fn shared(&mut self, b: Buf) -> Result<&'a [u8], String> {
        let slot = self
            .slots
            .get_mut(&b)
            .ok_or_else(|| err(format!("buffer {} not bound", b.0)))?;
        let bytes: &'a [u8] = match std::mem::replace(slot, Access::Taken) {
            Access::Mut(m) => m,
            Access::Shared(s) => s,
            Access::Taken => {
                return Err(format!(
                    "buffer {} read after it was written",
                    self.decls[b.index()].label
                ))
            }
        };
        *slot = Access::Shared(bytes);
        Ok(bytes)
    }

    /// Reads `b` as `T` (which must match its dtype).
    pub fn read<T: bytemuck::Pod>(&mut self, b: Buf) -> Result<&'a [T], String> {
        let bytes = self.shared(b)?;
        bytemuck::try_cast_slice(bytes).map_err(|e| format!("{}: {e}", self.decls[b.index()].label))
    }

    /// Reads a float buffer of any float dtype.
    pub fn floats(&mut self, b: Buf) -> Result<Floats<'a>, String> {
        Ok(match self.dtype(b) {
            DType::F32 => Floats::F32(self.read(b)?),
            DType::BF16 => Floats::BF16(self.read(b)?),
            DType::F16 => Floats::F16(self.read(b)?),
            other => return Err(format!("{} is {other}, not a float", self.decls[b.index()].label)),
        })
    }

    /// Raw bytes of `b`.
    pub fn bytes(&mut self, b: Buf) -> Result<&'a [u8], String> {
        self.shared(b)
    }

    /// Writes `b` as `T`; each written buffer is taken once.
    pub fn write<T: bytemuck::Pod>(&mut self, b: Buf) -> Result<&'a mut [T], String> {
        let label = &self.decls[b.index()].label;
        let slot = self
            .slots
            .get_mut(&b)
            .ok_or_else(|| format!("buffer {label} not bound"))?;
        match std::mem::replace(slot, Access::Taken) {
            Access::Mut(m) => bytemuck::try_cast_slice_mut(m).map_err(|e| format!("{label}: {e}")),
            _ => Err(format!("buffer {label} taken twice")),
        }
    }

    /// Raw bytes of `b` for writing (caches of any dtype).
    pub fn write_bytes(&mut self, b: Buf) -> Result<&'a mut [u8], String> {
        self.write(b)
    }
}
