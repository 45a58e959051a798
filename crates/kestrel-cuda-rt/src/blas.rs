//! cuBLAS: the dense matrix products of many-token passes, on any stream of the device, into
//! eager command lists or captured into CUDA graphs (a fixed workspace keeps it capture-safe).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{sys, CudaContext};
use kestrel_core::DType;

use crate::buffer::Buffer;
use crate::command::Gemm;
use crate::counters::Counters;
use crate::error::{CudaError, Result};
use crate::stream::Stream;

/// Bytes of the workspace cuBLAS gets; with it, it never allocates while a graph is captured.
const WORKSPACE_BYTES: usize = 32 << 20;

/// Every device's cuBLAS calls in the process, one at a time (a handle's creation and
/// destruction too), a captured one held from the capture's start to its end. Devices opened on
/// one GPU share its primary context, and destroying a handle synchronises the device: while
/// one thread captured a product, another device's handle destroyed at the same time broke the
/// capture (`CUBLAS_STATUS_INTERNAL_ERROR`, segfaults), which a lock per device did not stop.
static CALLS: Mutex<()> = Mutex::new(());

/// The process's turn at cuBLAS (see [`CALLS`]); taken before a device's handle or capture
/// stream.
pub(crate) fn calls() -> MutexGuard<'static, ()> {
    CALLS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A cuBLAS handle and its workspace.
pub struct Blas {
    handle: cublas_sys::cublasHandle_t,
    ctx: Arc<CudaContext>,
    counters: Arc<Counters>,
    _workspace: Buffer,
}

// SAFETY: the handle is only used through `&self` methods that bind the context; callers
// serialise use of one handle (the device keeps it behind a mutex).
unsafe impl Send for Blas {}

fn blas_err(call: &'static str) -> impl FnOnce(cublas::CublasError) -> CudaError {
    move |e| CudaError::Cublas {
        call,
        message: format!("{e:?}"),
    }
}

impl Blas {
    /// A handle on context `ctx` with a workspace that `alloc` makes (the device calls this
    /// once, see `Device::matmul_f32`).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        counters: &Arc<Counters>,
        alloc: impl FnOnce(usize) -> Result<Buffer>,
    ) -> Result<Blas> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        ctx.bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let workspace = alloc(WORKSPACE_BYTES)?;
        let handle = cublas::create_handle().map_err(blas_err("cublasCreate"))?;
        let blas = Blas {
            handle,
            ctx: ctx.clone(),
            counters: counters.clone(),
            _workspace: workspace.clone(),
        };
        // SAFETY: a live handle; the workspace stays allocated as long as the handle.
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(handle, workspace.device_ptr() as *mut _, WORKSPACE_BYTES)
                .result()
        }
        .map_err(blas_err("cublasSetWorkspace"))?;
        Ok(blas)
    }

    fn on(&self, stream: sys::CUstream) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: a live handle and a live stream of the same context.
        unsafe { cublas::set_stream(self.handle, stream as _) }.map_err(blas_err("cublasSetStream"))
    }

    /// `g`: `c[m, n] = a[m, k] · b[n, k]ᵀ`, row-major, `a` and `b` bf16, `c` f32, f32
    /// accumulation, enqueued on `stream`.
    ///
    /// # Safety
    /// The three buffers of `g` hold at least `m * k`, `n * k` bf16 and `m * n` f32 values and
    /// stay allocated until the product has run (the command holds them).
    pub(crate) unsafe fn gemm_bf16(&self, stream: sys::CUstream, g: &Gemm) -> Result<()> {
        let (a, b, c) = g.ptrs();
        let (m, n, k) = (g.m, g.n, g.k);
        self.on(stream)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major c = a · bᵀ is column-major cᵀ = b · aᵀ: b (k x n col-major, transposed
        // storage [n, k]) with op T, a ([m, k] row-major = k x m col-major) with op N.
        cublas::gemm_ex(
            self.handle,
            cublas_sys::cublasOperation_t::CUBLAS_OP_T,
            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            &alpha as *const f32 as *const _,
            b as *const _,
            cublas_sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            a as *const _,
            cublas_sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            &beta as *const f32 as *const _,
            c as *mut _,
            cublas_sys::cudaDataType::CUDA_R_32F,
            n as i32,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(blas_err("cublasGemmEx"))
    }

    /// `c[m, n] = a[m, k] · b[k, n]`, row-major f32, enqueued on `stream`.
    pub(crate) fn matmul_f32(
        &self,
        stream: &Stream,
        a: &Buffer,
        b: &Buffer,
        c: &Buffer,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        for (buf, elems) in [(a, m * k), (b, k * n), (c, m * n)] {
            if buf.dtype() != DType::F32 {
                return Err(CudaError::DTypeMismatch {
                    buffer: buf.dtype(),
                    host: DType::F32,
                });
            }
            if buf.elem_count() != elems {
                return Err(kestrel_core::CoreError::ShapeMismatch {
                    shape: buf.shape().dims().to_vec(),
                    elems: buf.elem_count(),
                    expected: elems,
                }
                .into());
            }
        }
        self.on(stream.cu())?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let op = cublas_sys::cublasOperation_t::CUBLAS_OP_N;
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: swap the operands and m with n.
        // SAFETY: the three views hold exactly the element counts checked above and stay
        // allocated until the call returns; cuBLAS enqueues on the compute stream.
        unsafe {
            cublas::sgemm(
                self.handle,
                op,
                op,
                n as i32,
                m as i32,
                k as i32,
                &alpha,
                b.device_ptr() as *const f32,
                n as i32,
                a.device_ptr() as *const f32,
                k as i32,
                &beta,
                c.device_ptr() as *mut f32,
                n as i32,
            )
        }
        .map_err(blas_err("cublasSgemm"))?;
        self.counters.add_dispatches(1);
        Ok(())
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // Destroying a handle synchronises the whole device, which would break a capture of
        // another device's product on this GPU.
        let _turn = calls();
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: the handle was created by `new` and is destroyed once.
        let _ = unsafe { cublas::destroy_handle(self.handle) };
    }
}
