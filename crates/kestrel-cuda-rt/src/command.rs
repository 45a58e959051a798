//! Command lists: a recorded sequence of kernel dispatches, each with its launch shape and its
//! arguments, buffer arguments tagged with how the kernel uses them.
//!
//! A list is built once with [`CommandList::dispatch`] (one builder for every combination of
//! arguments) and then run eagerly on a stream ([`crate::Device::run`]) or captured into a CUDA
//! graph ([`crate::Device::capture`]), whose edges come from the tagged buffer ranges.

use std::ffi::c_void;
use std::sync::Arc;

use crate::access::{Access, AccessMode};

use crate::buffer::Buffer;
use crate::registry::Kernel;

/// Grid or block dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dim3(pub u32, pub u32, pub u32);

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Dim3(x, 1, 1)
    }
}

impl From<(u32, u32)> for Dim3 {
    fn from((x, y): (u32, u32)) -> Self {
        Dim3(x, y, 1)
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Dim3(x, y, z)
    }
}

/// A scalar kernel argument: at most eight bytes, passed by value.
pub trait Scalar: bytemuck::Pod {}
impl Scalar for f32 {}
impl Scalar for f64 {}
impl Scalar for u32 {}
impl Scalar for i32 {}
impl Scalar for u64 {}
impl Scalar for i64 {}
impl Scalar for half::f16 {}
impl Scalar for half::bf16 {}

/// One kernel argument.
#[derive(Clone)]
pub enum Arg {
    /// A device pointer to a view, with the byte range it covers and how it is used.
    Buffer {
        access: Access,
        ptr: u64,
        keep_alive: Arc<dyn Send + Sync>,
    },
    /// A scalar value, stored little-endian in the low bytes of a word.
    Scalar { bits: u64 },
}

impl std::fmt::Debug for Arg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arg::Buffer { access, ptr, .. } => write!(f, "Buffer({:#x}, {:?})", ptr, access.mode),
            Arg::Scalar { bits } => write!(f, "Scalar({bits:#x})"),
        }
    }
}

impl Arg {
    /// The word the kernel parameter is read from (the driver reads the parameter's size).
    pub(crate) fn word(&self) -> u64 {
        match self {
            Arg::Buffer { ptr, .. } => *ptr,
            Arg::Scalar { bits } => *bits,
        }
    }
}

/// One recorded kernel launch.
#[derive(Debug, Clone)]
pub struct Dispatch {
    pub kernel: Kernel,
    pub grid: Dim3,
    pub block: Dim3,
    pub shared_mem: u32,
    pub args: Vec<Arg>,
    /// Defaults to the kernel name.
    pub label: String,
    /// The kernel follows the programmatic-launch contract (see
    /// [`DispatchBuilder::programmatic`]), so a graph may start it before the kernels it depends
    /// on have finished.
    pub programmatic: bool,
}

impl Dispatch {
    /// Every buffer range this dispatch reads or writes.
    pub fn accesses(&self) -> Vec<Access> {
        self.args
            .iter()
            .filter_map(|a| match a {
                Arg::Buffer { access, .. } => Some(*access),
                Arg::Scalar { .. } => None,
            })
            .collect()
    }

    /// Argument words; `KernelParams::pointers` points into them for one launch.
    pub(crate) fn params(&self) -> KernelParams {
        KernelParams {
            words: self.args.iter().map(Arg::word).collect(),
        }
    }

    /// The launch shape and the limits of its function, for error messages.
    pub(crate) fn describe_launch(&self) -> String {
        format!(
            "grid {:?}, block {:?}, {} bytes of dynamic shared memory, {} arguments; {}",
            self.grid,
            self.block,
            self.shared_mem,
            self.args.len(),
            self.kernel.limits()
        )
    }

    /// True when launching `self` and `other` differs only in argument values or launch shape.
    pub(crate) fn same_kernel(&self, other: &Dispatch) -> bool {
        self.kernel == other.kernel
            && self.args.len() == other.args.len()
            && self.programmatic == other.programmatic
    }

    /// True when the launch configuration or any argument differs.
    pub(crate) fn launch_differs(&self, other: &Dispatch) -> bool {
        self.grid != other.grid
            || self.block != other.block
            || self.shared_mem != other.shared_mem
            || self
                .args
                .iter()
                .zip(&other.args)
                .any(|(a, b)| a.word() != b.word())
    }
}

/// `c[m, n] = a[m, k] · b[n, k]ᵀ` through cuBLAS: `a`, `b` bf16 row-major, `c` f32 (f32
/// accumulation). The layer of a linear projection over many tokens.
#[derive(Debug, Clone)]
pub struct Gemm {
    pub a: Arg,
    pub b: Arg,
    pub c: Arg,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub label: String,
}

impl Gemm {
    pub(crate) fn ptrs(&self) -> (u64, u64, u64) {
        (self.a.word(), self.b.word(), self.c.word())
    }
}

/// One recorded command: a kernel launch or a cuBLAS product.
#[derive(Debug, Clone)]
pub enum Command {
    Launch(Dispatch),
    Gemm(Gemm),
}

impl Command {
    pub fn label(&self) -> &str {
        match self {
            Command::Launch(d) => &d.label,
            Command::Gemm(g) => &g.label,
        }
    }

    fn label_mut(&mut self) -> &mut String {
        match self {
            Command::Launch(d) => &mut d.label,
            Command::Gemm(g) => &mut g.label,
        }
    }

    /// Every buffer range the command reads or writes.
    pub fn accesses(&self) -> Vec<Access> {
        match self {
            Command::Launch(d) => d.accesses(),
            Command::Gemm(g) => [&g.a, &g.b, &g.c]
                .iter()
                .filter_map(|a| match a {
                    Arg::Buffer { access, .. } => Some(*access),
                    Arg::Scalar { .. } => None,
                })
                .collect(),
        }
    }
}

/// Storage for one launch's kernel parameters: one word per argument, and the array of
/// pointers to them that the driver reads (and copies) at launch or node creation.
pub(crate) struct KernelParams {
    words: Vec<u64>,
}

impl KernelParams {
    pub(crate) fn pointers(&mut self) -> Vec<*mut c_void> {
        self.words
            .iter_mut()
            .map(|w| w as *mut u64 as *mut c_void)
            .collect()
    }
}

/// A labelled sequence of dispatches.
#[derive(Debug, Clone, Default)]
pub struct CommandList {
    label: String,
    commands: Vec<Command>,
}

impl CommandList {
    /// `label` names the submission in errors and profiles.
    pub fn new(label: impl Into<String>) -> Self {
        CommandList {
            label: label.into(),
            commands: Vec::new(),
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn commands(&self) -> &[Command] {
        &self.commands
    }

    pub fn len(&self) -> usize {
        self.commands.len()
    }

    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// Prefixes the labels of commands `from..` with `prefix` (the node that recorded them).
    pub fn relabel_from(&mut self, from: usize, prefix: &str) {
        for c in &mut self.commands[from..] {
            let l = c.label_mut();
            *l = format!("{prefix}/{l}");
        }
    }

    pub fn clear(&mut self) {
        self.commands.clear();
    }

    /// Starts a dispatch of `kernel`; arguments are added in the kernel's parameter order and
    /// [`DispatchBuilder::record`] appends it. Grid and block default to one thread.
    pub fn dispatch<'a>(&'a mut self, kernel: &Kernel) -> DispatchBuilder<'a> {
        DispatchBuilder {
            list: self,
            dispatch: Dispatch {
                kernel: kernel.clone(),
                grid: Dim3(1, 1, 1),
                block: Dim3(1, 1, 1),
                shared_mem: 0,
                args: Vec::new(),
                label: kernel.name().to_string(),
                programmatic: false,
            },
        }
    }

    /// Records `c[m, n] = a[m, k] · b[n, k]ᵀ` (bf16 inputs, f32 output) through cuBLAS.
    pub fn gemm_bf16(&mut self, a: &Buffer, b: &Buffer, c: &Buffer, m: usize, n: usize, k: usize) {
        let arg = |buf: &Buffer, mode| Arg::Buffer {
            access: buf.access(mode),
            ptr: buf.device_ptr(),
            keep_alive: buf.keep_alive(),
        };
        self.commands.push(Command::Gemm(Gemm {
            a: arg(a, AccessMode::Read),
            b: arg(b, AccessMode::Read),
            c: arg(c, AccessMode::Write),
            m,
            n,
            k,
            label: "gemm_bf16".into(),
        }));
    }
}

/// Builds one dispatch; see [`CommandList::dispatch`].
#[must_use = "a dispatch is only added by .record()"]
pub struct DispatchBuilder<'a> {
    list: &'a mut CommandList,
    dispatch: Dispatch,
}

impl DispatchBuilder<'_> {
    pub fn grid(mut self, grid: impl Into<Dim3>) -> Self {
        self.dispatch.grid = grid.into();
        self
    }

    pub fn block(mut self, block: impl Into<Dim3>) -> Self {
        self.dispatch.block = block.into();
        self
    }

    /// One-dimensional launch covering `n` threads with blocks of `block` threads.
    pub fn cover(self, n: usize, block: u32) -> Self {
        let blocks = (n as u64).div_ceil(block as u64).max(1) as u32;
        self.grid(blocks).block(block)
    }

    /// Dynamic shared memory in bytes.
    pub fn shared_mem(mut self, bytes: u32) -> Self {
        self.dispatch.shared_mem = bytes;
        self
    }

    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.dispatch.label = label.into();
        self
    }

    /// Declares that the kernel keeps the programmatic-launch contract of `kestrel.cuh`: every
    /// block calls `pdl_wait()` before it reads anything an earlier dispatch writes and before
    /// it writes anything, and calls `pdl_trigger()` only after that. A CUDA graph then links it
    /// to the kernels it depends on with programmatic edges: it launches while they finish, and
    /// whatever it does before the wait (loading weights) overlaps their tail. Eager runs ignore
    /// it (the wait returns at once when nothing is pending).
    pub fn programmatic(mut self) -> Self {
        self.dispatch.programmatic = true;
        self
    }

    /// A buffer argument the kernel only reads.
    pub fn read(self, buf: &Buffer) -> Self {
        self.buffer(buf, AccessMode::Read)
    }

    /// A buffer argument the kernel only writes.
    pub fn write(self, buf: &Buffer) -> Self {
        self.buffer(buf, AccessMode::Write)
    }

    /// A buffer argument the kernel reads and writes.
    pub fn read_write(self, buf: &Buffer) -> Self {
        self.buffer(buf, AccessMode::ReadWrite)
    }

    pub fn buffer(mut self, buf: &Buffer, mode: AccessMode) -> Self {
        self.dispatch.args.push(Arg::Buffer {
            access: buf.access(mode),
            ptr: buf.device_ptr(),
            keep_alive: buf.keep_alive(),
        });
        self
    }

    /// A scalar argument passed by value.
    pub fn arg<S: Scalar>(mut self, value: S) -> Self {
        let mut bits = [0u8; 8];
        let bytes = bytemuck::bytes_of(&value);
        bits[..bytes.len()].copy_from_slice(bytes);
        self.dispatch.args.push(Arg::Scalar {
            bits: u64::from_le_bytes(bits),
        });
        self
    }

    /// Appends the dispatch to the list.
    pub fn record(self) {
        self.list.commands.push(Command::Launch(self.dispatch));
    }
}
