//! cuBLAS on the device's compute stream: the dense matrix products that many-token passes use.

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use kestrel_core::DType;

use crate::buffer::Buffer;
use crate::device::Device;
use crate::error::{CudaError, Result};

/// A cuBLAS handle bound to a device's compute stream.
pub struct Blas {
    handle: cublas_sys::cublasHandle_t,
    device: Device,
}

// SAFETY: the handle is used only through `&self` methods that bind the context, and cuBLAS
// handles may be used from any thread as long as calls do not overlap, which the compute
// stream's ordering and these methods' synchronous host part guarantee for one handle per device.
unsafe impl Send for Blas {}

fn blas_err(call: &'static str) -> impl FnOnce(cublas::CublasError) -> CudaError {
    move |e| CudaError::Cublas {
        call,
        message: format!("{e:?}"),
    }
}

impl Blas {
    pub fn new(device: &Device) -> Result<Blas> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let handle = cublas::create_handle().map_err(blas_err("cublasCreate"))?;
        let blas = Blas {
            handle,
            device: device.clone(),
        };
        // SAFETY: a live handle and a live stream of the same context.
        unsafe { cublas::set_stream(handle, device.compute().cu() as _) }
            .map_err(blas_err("cublasSetStream"))?;
        Ok(blas)
    }

    /// `c[m, n] = a[m, k] · b[k, n]`, row-major f32, on the compute stream (asynchronous).
    pub fn matmul_f32(&self, a: &Buffer, b: &Buffer, c: &Buffer, m: usize, n: usize, k: usize) -> Result<()> {
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
        self.device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
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
        self.device.counters_ref().add_dispatches(1);
        Ok(())
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let ctx = self.device.context();
        ctx.record_err(ctx.bind_to_thread());
        // SAFETY: the handle was created by `new` and is destroyed once.
        let _ = unsafe { cublas::destroy_handle(self.handle) };
    }
}
