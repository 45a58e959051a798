//! The `Backend` trait: what every executor of op graphs provides (the CPU reference and CUDA).
//!
//! A backend prepares a [`Graph`] into a program (memory planned, persistent buffers allocated
//! by label and shared between programs, kernels chosen), moves bytes in and out of a program's
//! buffers, and runs it. Ops are not trait methods: a backend matches on [`crate::ir::Op`] and
//! hands each family to its own module, so adding an op touches no trait.

use crate::dtype::HostType;
use crate::error::CoreError;
use crate::ir::{Buf, BufDecl, Graph};

pub trait Backend {
    /// A graph prepared for this backend.
    type Program;
    type Error: std::error::Error + From<CoreError> + Send + Sync + 'static;
    /// Host memory the backend copies from fastest (page-locked on CUDA), for bytes the host
    /// keeps and writes into buffers again and again (streamed experts).
    type HostBuffer;

    fn name(&self) -> &'static str;

    /// The element type of the norm outputs that feed only projections, for a chunk of `tokens`
    /// tokens: bf16 where the backend's products of that many tokens round their activations to
    /// bf16 anyway (the norm then writes them rounded, and no conversion pass runs), else f32.
    fn projection_input_dtype(&self, tokens: usize) -> crate::DType {
        let _ = tokens;
        crate::DType::F32
    }

    /// Whether `err` is the backend running out of memory, which dropping programs may cure
    /// (the caller may free some and prepare again).
    fn is_out_of_memory(err: &Self::Error) -> bool {
        let _ = err;
        false
    }

    /// Plans the graph's memory, allocates (zeroed) any weight or state not allocated by an
    /// earlier program, and prepares execution.
    fn prepare(&mut self, graph: &Graph) -> Result<Self::Program, Self::Error>;

    /// The graph a program was prepared from.
    fn graph(program: &Self::Program) -> &Graph;

    /// Copies `bytes` into `buf` starting `offset` bytes in. Bounds are checked by the caller.
    fn write_bytes(
        &mut self,
        program: &mut Self::Program,
        buf: Buf,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), Self::Error>;

    /// Sets `len` bytes of `buf` from `offset` on to zero (a new sequence's recurrent states).
    /// Bounds are checked by the caller. By default it writes zeros from the host; a device
    /// backend sets them where they are.
    fn zero_bytes(
        &mut self,
        program: &mut Self::Program,
        buf: Buf,
        offset: usize,
        len: usize,
    ) -> Result<(), Self::Error> {
        self.write_bytes(program, buf, offset, &vec![0u8; len])
    }

    /// Copies `len` bytes of `buf` from offset `src` to offset `dst` (ranges that do not
    /// overlap; a recurrent state's row into a snapshot's and back). Bounds are checked by the
    /// caller. By default through the host; a device backend copies where they are.
    fn copy_bytes(
        &mut self,
        program: &mut Self::Program,
        buf: Buf,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<(), Self::Error> {
        let mut bytes = vec![0u8; src + len];
        self.read_bytes(program, buf, &mut bytes)?;
        self.write_bytes(program, buf, dst, &bytes[src..])
    }

    /// Copies the first `out.len()` bytes of `buf`. Bounds are checked by the caller.
    fn read_bytes(&mut self, program: &Self::Program, buf: Buf, out: &mut [u8]) -> Result<(), Self::Error>;

    /// Runs every node in order. Inputs must have been written.
    fn run(&mut self, program: &mut Self::Program) -> Result<(), Self::Error>;

    /// `bytes` of zeroed host memory of the kind [`Backend::write_from_host`] copies from fastest.
    fn alloc_host(&mut self, bytes: usize) -> Result<Self::HostBuffer, Self::Error>;

    /// The host buffer's bytes, to fill (after any copy still reading them has finished).
    fn host_bytes_mut(host: &mut Self::HostBuffer) -> Result<&mut [u8], Self::Error>;

    /// Makes `host` the storage of the host weight (`BufKind::HostWeight`) labelled `label`,
    /// a `u8` buffer of `host`'s length, for every program prepared from now on, which read it
    /// in place: the caller fills it (through [`Backend::host_bytes_mut`]) before adopting it,
    /// instead of uploading. Without this, `prepare` allocates a zeroed one.
    fn adopt_host(&mut self, label: &str, host: Self::HostBuffer) -> Result<(), Self::Error>;

    /// Writes `src[range]` at byte `offset` of `buf`, ordered with the runs as `write_bytes` is.
    fn write_from_host(
        &mut self,
        program: &mut Self::Program,
        buf: Buf,
        offset: usize,
        src: &Self::HostBuffer,
        range: std::ops::Range<usize>,
    ) -> Result<(), Self::Error>;

    /// Writes `data` at the start of `buf`: a shorter slice fills a prefix, a longer one is an
    /// error, and so is a dtype other than the buffer's.
    fn upload<T: HostType>(
        &mut self,
        program: &mut Self::Program,
        buf: impl Into<Buf>,
        data: &[T],
    ) -> Result<(), Self::Error> {
        self.upload_at(program, buf, 0, data)
    }

    /// Writes `data` starting at element `offset` of `buf`.
    fn upload_at<T: HostType>(
        &mut self,
        program: &mut Self::Program,
        buf: impl Into<Buf>,
        offset: usize,
        data: &[T],
    ) -> Result<(), Self::Error> {
        let buf = buf.into();
        let d = Self::graph(program).decl(buf);
        check_dtype::<T>(d)?;
        if offset + data.len() > d.elem_count() {
            return Err(CoreError::OutOfBounds {
                label: d.label.clone(),
                offset,
                len: data.len(),
                capacity: d.elem_count(),
            }
            .into());
        }
        let size = std::mem::size_of::<T>();
        self.write_bytes(program, buf, offset * size, bytemuck::cast_slice(data))
    }

    /// Reads the whole of `buf`.
    fn download<T: HostType>(
        &mut self,
        program: &Self::Program,
        buf: impl Into<Buf>,
    ) -> Result<Vec<T>, Self::Error> {
        let buf = buf.into();
        let d = Self::graph(program).decl(buf);
        check_dtype::<T>(d)?;
        let mut out = vec![T::zeroed(); d.elem_count()];
        self.read_bytes(program, buf, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }
}

/// Host data of type `T` may only go to or come from a buffer of `T`'s dtype.
fn check_dtype<T: HostType>(d: &BufDecl) -> Result<(), CoreError> {
    if d.dtype != T::DTYPE {
        return Err(CoreError::DTypeMismatch {
            label: d.label.clone(),
            buffer: d.dtype,
            host: T::DTYPE,
        });
    }
    Ok(())
}
