//! Streams that remember what was submitted to them, so a device failure is reported with the
//! label of the submission that was running, and the host↔device copies made on them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};
use kestrel_core::HostType;

use crate::buffer::{Buffer, PinnedBuffer};
use crate::counters::Counters;
use crate::error::{is_sticky, CudaError, Result};

/// A submission whose completion has not been observed yet.
struct Pending {
    label: String,
    done: CudaEvent,
}

/// A CUDA stream plus the labels of its in-flight submissions.
pub struct Stream {
    raw: Arc<CudaStream>,
    name: &'static str,
    counters: Arc<Counters>,
    pending: Mutex<VecDeque<Pending>>,
    spare_events: Mutex<Vec<CudaEvent>>,
}

impl Stream {
    pub(crate) fn new(ctx: &Arc<CudaContext>, name: &'static str, counters: Arc<Counters>) -> Result<Self> {
        let raw = ctx.new_stream().map_err(CudaError::driver("cuStreamCreate"))?;
        Ok(Stream {
            raw,
            name,
            counters,
            pending: Mutex::new(VecDeque::new()),
            spare_events: Mutex::new(Vec::new()),
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn raw(&self) -> &Arc<CudaStream> {
        &self.raw
    }

    pub(crate) fn cu(&self) -> sys::CUstream {
        self.raw.cu_stream()
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        self.raw.context()
    }

    /// Marks the end of a submission: records an event so a later failure can be attributed to
    /// `label`, and forgets submissions already complete. No host synchronisation.
    pub(crate) fn end_submission(&self, label: &str) -> Result<()> {
        self.counters.add_submissions(1);
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.retire_completed(&mut pending)?;
        let event = match self.spare_events.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            Some(e) => e,
            None => self
                .context()
                .new_event(None)
                .map_err(|e| self.fail("cuEventCreate", e, &pending))?,
        };
        event
            .record(&self.raw)
            .map_err(|e| self.fail("cuEventRecord", e, &pending))?;
        pending.push_back(Pending {
            label: label.to_string(),
            done: event,
        });
        Ok(())
    }

    fn retire_completed(&self, pending: &mut VecDeque<Pending>) -> Result<()> {
        while let Some(front) = pending.front() {
            match front.done.try_is_complete() {
                Ok(true) => {
                    let p = pending.pop_front().expect("front exists");
                    self.spare_events
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(p.done);
                }
                Ok(false) => break,
                Err(e) => return Err(self.fail("cuEventQuery", e, pending)),
            }
        }
        Ok(())
    }

    /// Turns a driver error into a [`CudaError`]. A sticky error comes from work already
    /// submitted, so it is reported against the oldest submission not yet seen complete.
    fn fail(&self, call: &'static str, e: DriverError, pending: &VecDeque<Pending>) -> CudaError {
        if is_sticky(&e) {
            let submission = pending
                .front()
                .map(|p| p.label.clone())
                .unwrap_or_else(|| format!("(unlabelled work on the {} stream)", self.name));
            CudaError::Submission {
                submission,
                source: e,
            }
        } else {
            CudaError::Driver { call, source: e }
        }
    }

    pub(crate) fn map_err(&self, call: &'static str) -> impl FnOnce(DriverError) -> CudaError + '_ {
        move |e| {
            let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            self.fail(call, e, &pending)
        }
    }

    /// Blocks the host until everything submitted to this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.counters.add_host_syncs(1);
        self.raw
            .synchronize()
            .map_err(self.map_err("cuStreamSynchronize"))?;
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut spare = self.spare_events.lock().unwrap_or_else(|p| p.into_inner());
        spare.extend(pending.drain(..).map(|p| p.done));
        Ok(())
    }

    /// Labels of submissions not yet seen complete, oldest first.
    pub fn pending_labels(&self) -> Vec<String> {
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.iter().map(|p| p.label.clone()).collect()
    }

    /// Makes this stream wait, on the device, for `event`.
    pub(crate) fn wait_event(&self, event: &CudaEvent) -> Result<()> {
        self.raw.wait(event).map_err(self.map_err("cuStreamWaitEvent"))
    }

    /// Copies `src` into the start of `dst`. A shorter `src` fills a prefix; a longer one is an
    /// error. `src` may be freed as soon as this returns (the driver stages pageable memory).
    pub fn upload<T: HostType>(&self, dst: &Buffer, src: &[T]) -> Result<()> {
        let bytes = check_copy::<T>(dst, src.len())?;
        self.context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: `dst` is a live allocation and `bytes` fits in the view (checked above);
        // `src` holds `bytes` bytes; pageable sources are staged before the call returns.
        unsafe { result::memcpy_htod_async(dst.device_ptr(), bytemuck::cast_slice::<T, u8>(src), self.cu()) }
            .map_err(self.map_err("cuMemcpyHtoDAsync"))?;
        self.counters.add_bytes_h2d(bytes as u64);
        Ok(())
    }

    /// Copies the start of `src` into `dst`, waiting for the copy (and all earlier work on this
    /// stream). A shorter `dst` reads a prefix; a longer one is an error.
    pub fn download_into<T: HostType>(&self, src: &Buffer, dst: &mut [T]) -> Result<()> {
        let bytes = check_copy::<T>(src, dst.len())?;
        self.context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: `src` is live and holds at least `bytes` bytes; `dst` is exclusively borrowed
        // and the synchronisation below completes the copy before the borrow ends.
        unsafe {
            result::memcpy_dtoh_async(
                bytemuck::cast_slice_mut::<T, u8>(dst),
                src.device_ptr(),
                self.cu(),
            )
        }
        .map_err(self.map_err("cuMemcpyDtoHAsync"))?;
        self.counters.add_bytes_d2h(bytes as u64);
        self.synchronize()
    }

    /// Downloads the whole view.
    pub fn download<T: HostType>(&self, src: &Buffer) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); src.byte_len() / std::mem::size_of::<T>().max(1)];
        self.download_into(src, &mut out)?;
        Ok(out)
    }

    /// Asynchronous copy from pinned memory. The buffer remembers the copy, and waits for it
    /// before it is written, read mutably or freed.
    pub fn upload_pinned<T: HostType>(&self, dst: &Buffer, src: &PinnedBuffer<T>) -> Result<()> {
        let bytes = check_copy::<T>(dst, src.len())?;
        self.context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: `src` is page-locked and stays allocated until the event recorded below
        // completes (its Drop and mutable accessors wait for it); `dst` is live and large enough.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.device_ptr(), src.as_ptr_unchecked().cast(), bytes, self.cu())
                .result()
        }
        .map_err(self.map_err("cuMemcpyHtoDAsync"))?;
        self.counters.add_bytes_h2d(bytes as u64);
        src.track_use(self.record_event(None)?)
    }

    /// Asynchronous copy of `dst.byte_len()` bytes of `src` from byte `offset` into `dst`, on
    /// the copy engine (page-locked source).
    pub fn upload_pinned_range(&self, dst: &Buffer, src: &PinnedBuffer<u8>, offset: usize) -> Result<()> {
        let bytes = dst.byte_len();
        if offset.checked_add(bytes).is_none_or(|end| end > src.len()) {
            return Err(CudaError::HostRangeOutside {
                offset,
                len: bytes,
                host_bytes: src.len(),
            });
        }
        self.context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: `src` is page-locked and holds `offset + bytes` bytes (checked above); it stays
        // allocated until the event recorded below completes (its Drop and mutable accessors
        // wait for it); `dst` is live and `bytes` long.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.device_ptr(),
                src.as_ptr_unchecked().add(offset).cast(),
                bytes,
                self.cu(),
            )
            .result()
        }
        .map_err(self.map_err("cuMemcpyHtoDAsync"))?;
        self.counters.add_bytes_h2d(bytes as u64);
        src.track_use(self.record_event(None)?)
    }

    /// Asynchronous copy into pinned memory; read it after [`PinnedBuffer::as_slice`] (which
    /// waits for the copy).
    pub fn download_pinned<T: HostType>(&self, src: &Buffer, dst: &mut PinnedBuffer<T>) -> Result<()> {
        let bytes = check_copy::<T>(src, dst.len())?;
        self.context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: as for `upload_pinned`; `dst` is exclusively borrowed now, and every later
        // access waits for the recorded event.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr_unchecked().cast(),
                src.device_ptr(),
                bytes,
                self.cu(),
            )
            .result()
        }
        .map_err(self.map_err("cuMemcpyDtoHAsync"))?;
        self.counters.add_bytes_d2h(bytes as u64);
        dst.track_use(self.record_event(None)?)
    }

    /// Device-to-device copy of `src` into the start of `dst` (asynchronous).
    pub fn copy(&self, dst: &Buffer, src: &Buffer) -> Result<()> {
        if src.byte_len() > dst.byte_len() {
            return Err(CudaError::CopyTooLong {
                host_bytes: src.byte_len(),
                buffer_bytes: dst.byte_len(),
            });
        }
        self.context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: both allocations are live; the range fits in `dst` (checked above).
        unsafe { result::memcpy_dtod_async(dst.device_ptr(), src.device_ptr(), src.byte_len(), self.cu()) }
            .map_err(self.map_err("cuMemcpyDtoDAsync"))?;
        self.counters.add_bytes_d2d(src.byte_len() as u64);
        Ok(())
    }

    /// Sets every byte of `dst` to `value` (asynchronous).
    pub fn fill(&self, dst: &Buffer, value: u8) -> Result<()> {
        self.context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: the view is live and `byte_len` bytes long.
        unsafe { result::memset_d8_async(dst.device_ptr(), value, dst.byte_len(), self.cu()) }
            .map_err(self.map_err("cuMemsetD8Async"))
    }

    pub(crate) fn record_event(&self, flags: Option<sys::CUevent_flags>) -> Result<CudaEvent> {
        self.raw
            .record_event(flags)
            .map_err(self.map_err("cuEventRecord"))
    }
}

/// Checks a host↔device copy of `n` elements of `T` against a view: the element type must be the
/// view's and the bytes must fit. Returns the byte count.
fn check_copy<T: HostType>(buf: &Buffer, n: usize) -> Result<usize> {
    if T::DTYPE != buf.dtype() {
        return Err(CudaError::DTypeMismatch {
            buffer: buf.dtype(),
            host: T::DTYPE,
        });
    }
    let bytes = n * std::mem::size_of::<T>();
    if bytes > buf.byte_len() {
        return Err(CudaError::CopyTooLong {
            host_bytes: bytes,
            buffer_bytes: buf.byte_len(),
        });
    }
    Ok(bytes)
}
