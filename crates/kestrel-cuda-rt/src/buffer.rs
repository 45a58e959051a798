//! Typed device buffers, views into them, and page-locked host buffers for staging.
//!
//! A [`Buffer`] is a view `(allocation, byte offset, dtype, shape)`; cloning it or taking a
//! sub-view shares the allocation. A view's length is its own: copies, kernel arguments and
//! the dependency analysis see only the view's bytes, never the rest of the allocation.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaEvent};
use kestrel_core::{DType, HostType, Shape};

use crate::access::{Access, AccessMode, AllocId};

use crate::error::{CudaError, Result};

static NEXT_ALLOC_ID: AtomicU64 = AtomicU64::new(1);

/// One device allocation, or page-locked host memory the device reads and writes in place;
/// freed when the last view of it is dropped.
pub(crate) struct Allocation {
    id: AllocId,
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
    /// The host memory behind `ptr`, for mapped host memory (freed by its own drop).
    host: Option<PinnedBuffer<u8>>,
}

impl Allocation {
    /// Allocates `bytes` (at least one byte, so every allocation has a distinct address).
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Allocation> {
        ctx.bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: plain allocation; the memory is zeroed by the caller before any view of it
        // is handed out.
        let ptr = match unsafe { result::malloc_sync(bytes.max(1)) } {
            Ok(p) => p,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let (free, total) = result::mem_get_info().unwrap_or((0, 0));
                return Err(CudaError::OutOfMemory {
                    requested: bytes,
                    free,
                    total,
                });
            }
            Err(e) => {
                return Err(CudaError::Driver {
                    call: "cuMemAlloc",
                    source: e,
                })
            }
        };
        Ok(Allocation {
            id: AllocId(NEXT_ALLOC_ID.fetch_add(1, Ordering::Relaxed)),
            ptr,
            bytes,
            ctx: ctx.clone(),
            host: None,
        })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.host.is_some() {
            // The pinned buffer frees itself; the device address was only a mapping of it.
            return;
        }
        // Errors cannot propagate out of Drop; the context records them for its next check.
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `ptr` came from cuMemAlloc and this is the only owner; cuMemFree waits for
        // work still using it.
        self.ctx.record_err(unsafe { result::free_sync(self.ptr) });
    }
}

/// A typed view of device memory.
#[derive(Clone)]
pub struct Buffer {
    alloc: Arc<Allocation>,
    offset: usize,
    dtype: DType,
    shape: Shape,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Buffer({} {:?} at alloc {} + {} bytes)",
            self.dtype, self.shape, self.alloc.id.0, self.offset
        )
    }
}

impl Buffer {
    /// Page-locked host memory as a `u8` buffer the device reads and writes in place (kernels
    /// get its device address; copies to and from it run like any buffer's).
    pub fn mapped_host(host: PinnedBuffer<u8>) -> Result<Buffer> {
        let ptr = host.device_ptr()?;
        let (bytes, ctx) = (host.len(), host.ctx.clone());
        let alloc = Allocation {
            id: AllocId(NEXT_ALLOC_ID.fetch_add(1, Ordering::Relaxed)),
            ptr,
            bytes,
            ctx,
            host: Some(host),
        };
        Ok(Buffer::whole(alloc, DType::U8, Shape::from(bytes)))
    }

    pub(crate) fn whole(alloc: Allocation, dtype: DType, shape: Shape) -> Buffer {
        Buffer {
            alloc: Arc::new(alloc),
            offset: 0,
            dtype,
            shape,
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }

    /// Bytes of this view (not of the allocation behind it).
    pub fn byte_len(&self) -> usize {
        self.elem_count() * self.dtype.size_in_bytes()
    }

    /// Offset of this view from the start of its allocation.
    pub fn byte_offset(&self) -> usize {
        self.offset
    }

    /// Bytes of the whole allocation behind this view.
    pub fn allocation_bytes(&self) -> usize {
        self.alloc.bytes
    }

    pub fn alloc_id(&self) -> AllocId {
        self.alloc.id
    }

    /// Device address of the view's first byte: what a kernel receives as its pointer.
    pub fn device_ptr(&self) -> u64 {
        self.alloc.ptr + self.offset as u64
    }

    /// A sub-view starting `byte_offset` bytes into this view, with its own dtype and shape.
    /// It must lie inside this view and be aligned to its element size.
    pub fn view(&self, byte_offset: usize, dtype: DType, shape: impl Into<Shape>) -> Result<Buffer> {
        let shape = shape.into();
        let len = shape.elem_count() * dtype.size_in_bytes();
        if byte_offset
            .checked_add(len)
            .is_none_or(|end| end > self.byte_len())
        {
            return Err(CudaError::ViewOutOfBounds {
                offset: byte_offset,
                len,
                capacity: self.byte_len(),
            });
        }
        let offset = self.offset + byte_offset;
        if offset % dtype.size_in_bytes() != 0 {
            return Err(CudaError::MisalignedView { offset, dtype });
        }
        Ok(Buffer {
            alloc: self.alloc.clone(),
            offset,
            dtype,
            shape,
        })
    }

    /// The same bytes as a 1-D `u8` view.
    pub fn bytes(&self) -> Buffer {
        Buffer {
            alloc: self.alloc.clone(),
            offset: self.offset,
            dtype: DType::U8,
            shape: Shape::from(self.byte_len()),
        }
    }

    /// Elements `[start, start + len)` of a view, as a 1-D view of the same dtype.
    pub fn slice(&self, start: usize, len: usize) -> Result<Buffer> {
        self.view(start * self.dtype.size_in_bytes(), self.dtype, len)
    }

    /// The byte range this view covers, as the dependency analysis sees it.
    pub fn access(&self, mode: AccessMode) -> Access {
        Access::new(self.alloc.id, self.offset as u64, self.byte_len() as u64, mode)
    }

    /// Keeps the allocation alive for as long as a recorded command refers to it.
    pub(crate) fn keep_alive(&self) -> Arc<dyn Send + Sync> {
        self.alloc.clone()
    }
}

// SAFETY: the allocation is a device address plus an Arc'd context; nothing in it is tied to
// the creating thread (every use binds the context first).
unsafe impl Send for Allocation {}
unsafe impl Sync for Allocation {}

/// Page-locked host memory, the fast path for host↔device copies, mapped into the device's
/// address space (see [`Buffer::mapped_host`]).
///
/// Asynchronous copies record an event in the buffer; reading, writing and freeing wait for
/// every copy still using it, so the host never races the DMA engine.
pub struct PinnedBuffer<T: HostType> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
    in_flight: Mutex<Vec<CudaEvent>>,
    _marker: PhantomData<T>,
}

// SAFETY: the memory is plain host memory owned by this value; concurrent access is governed by
// `&`/`&mut` and the in-flight events, which are themselves thread-safe.
unsafe impl<T: HostType> Send for PinnedBuffer<T> {}
unsafe impl<T: HostType> Sync for PinnedBuffer<T> {}

impl<T: HostType> PinnedBuffer<T> {
    /// `len` zeroed elements of page-locked memory.
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let bytes = len * std::mem::size_of::<T>();
        ctx.bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a plain page-locked allocation of `bytes` (at least 1) bytes, zeroed below
        // before any typed access; all-zero bits are valid for every HostType (they are Pod).
        let ptr = unsafe { result::malloc_host(bytes.max(1), flags) }.map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                CudaError::OutOfPinnedMemory { requested: bytes }
            } else {
                CudaError::Driver {
                    call: "cuMemHostAlloc",
                    source: e,
                }
            }
        })? as *mut T;
        // SAFETY: `ptr` points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(PinnedBuffer {
            ptr,
            len,
            ctx: ctx.clone(),
            in_flight: Mutex::new(Vec::new()),
            _marker: PhantomData,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waits for every copy still using the buffer.
    pub fn wait(&self) -> Result<()> {
        let mut events = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        for e in events.drain(..) {
            e.synchronize().map_err(CudaError::driver("cuEventSynchronize"))?;
        }
        Ok(())
    }

    /// The contents, after every copy into or out of the buffer has finished.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait()?;
        // SAFETY: `ptr` holds `len` initialised elements; no copy is in flight (waited above)
        // and new device writes need `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait()?;
        // SAFETY: as above, and `&mut self` excludes every other host access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// The address kernels use for this memory (the same as the host's under unified
    /// addressing, which every 64-bit CUDA platform has).
    pub fn device_ptr(&self) -> Result<u64> {
        let mut dptr: sys::CUdeviceptr = 0;
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: `ptr` is a live cuMemHostAlloc allocation made with DEVICEMAP; the call only
        // writes the mapped address into `dptr`.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, self.ptr as *mut _, 0) }
            .result()
            .map_err(CudaError::driver("cuMemHostGetDevicePointer"))?;
        Ok(dptr)
    }

    pub(crate) fn as_ptr_unchecked(&self) -> *const T {
        self.ptr
    }

    pub(crate) fn as_mut_ptr_unchecked(&mut self) -> *mut T {
        self.ptr
    }

    /// Records that the operation before `event` (recorded on its stream) uses this buffer.
    pub(crate) fn track_use(&self, event: CudaEvent) -> Result<()> {
        let mut events = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        events.retain(|e| !e.is_complete());
        events.push(event);
        Ok(())
    }
}

impl<T: HostType> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        // Never free memory a DMA may still touch. If waiting fails the context is broken;
        // the error is recorded and the memory freed anyway, as the device no longer runs.
        if let Err(CudaError::Driver { source, .. }) = self.wait() {
            self.ctx.record_err::<()>(Err(source));
        }
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `ptr` came from cuMemHostAlloc and no copy uses it any more.
        self.ctx
            .record_err(unsafe { result::free_host(self.ptr as *mut _) });
    }
}
