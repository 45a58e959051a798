//! A CUDA device: its context, a compute and a copy stream, the kernel registry, counters and
//! the profiler, and the operations that allocate memory and run command lists.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{result, sys, CudaContext, CudaEvent};
use kestrel_core::{Config, DType, HostType, Shape};

use crate::blas::Blas;
use crate::buffer::{Allocation, Buffer, PinnedBuffer};
use crate::ceilings::{self, Ceilings};
use crate::command::{Command, CommandList};
use crate::counters::{CounterSnapshot, Counters, Profile};
use crate::error::{CudaError, Result};
use crate::registry::{arch_name, hopper_target, nvrtc_version, Kernel, KernelRegistry, ModuleSource};
use crate::stream::Stream;

/// What a device is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
    pub sm_count: u32,
    pub total_memory: usize,
    pub l2_bytes: usize,
    /// Shared memory one block may opt into.
    pub max_shared_per_block: usize,
    pub memory_bus_bits: u32,
}

/// Whether the CUDA driver library can be loaded at all.
pub fn driver_present() -> bool {
    // SAFETY: only probes whether libcuda can be opened.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices; an error when no driver is installed.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(CudaError::NoDriver("libcuda"));
    }
    result::init().map_err(CudaError::driver("cuInit"))?;
    let n = result::device::get_count().map_err(CudaError::driver("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

/// A handle to an open device; cheap to clone.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
    compute: Stream,
    copy: Stream,
    registry: KernelRegistry,
    counters: Arc<Counters>,
    profiling: AtomicBool,
    /// Graphs use programmatic edges (`Config::pdl`).
    pdl: bool,
    /// GEMM tiles on `wgmma` (`Config::wgmma` on an sm_90 device with NVRTC 12 or newer).
    wgmma: bool,
    /// Routed experts of a few dozen rows on `wgmma` too (`Config::wide_experts`, with `wgmma`).
    wide_experts: bool,
    /// Projections of a few dozen tokens on `wgmma` too (`Config::wide_projections`, with `wgmma`).
    wide_projections: bool,
    /// One token's attention inputs inside its decode attention kernel (`Config::fused_attention`).
    fused_attention: bool,
    /// One token's RMS norm inside the quantised product that reads it (`Config::fused_norm`).
    fused_norm: bool,
    /// A router's logits of many tokens bounded first (`Config::bounded_router`).
    bounded_router: bool,
    /// The fewest cached keys a block of decode attention takes (`Config::decode_split_keys`).
    decode_split_keys: usize,
    /// The fewest tokens whose quantised experts take the skinny products
    /// (`Config::skinny_experts_from`).
    skinny_experts_from: usize,
    /// The fewest tokens whose quantised projections are dequantised for cuBLAS
    /// (`Config::dequant_projections_from`; 0: never).
    dequant_projections_from: usize,
    /// bf16 copies of the projections products of many tokens dequantise, kept
    /// (`Config::projection_copies`).
    projection_copies: bool,
    /// Event pairs around profiled dispatches, read back by `take_profile`.
    profile_events: Mutex<Vec<(String, String, CudaEvent, CudaEvent)>>,
    /// The cuBLAS handle, created on first use.
    blas: Mutex<Option<Blas>>,
    /// A stream that only ever captures cuBLAS calls into child graphs; the lock is held from
    /// the start of a capture to its end, so threads building graphs at once take turns.
    capture: Mutex<Stream>,
    /// Copy bandwidth and bf16 GEMM rate, from the table or measured on first use.
    ceilings: OnceLock<Ceilings>,
}

impl Device {
    /// Opens device `ordinal` with the process configuration.
    pub fn open(ordinal: usize, config: &Config) -> Result<Device> {
        config.check()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
        // Kestrel orders work itself (streams, fences, graph edges); cudarc's per-slice event
        // tracking would add events to every launch for nothing.
        // SAFETY: no cudarc CudaSlice is ever created on this context.
        unsafe { ctx.disable_event_tracking() };
        let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
            ctx.attribute(a)
                .map_err(CudaError::driver("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute::*;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(CudaError::driver("cuDeviceGetAttribute"))?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(CudaError::driver("cuDeviceGetName"))?,
            compute_capability: (major as u32, minor as u32),
            sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            total_memory: ctx.total_mem().map_err(CudaError::driver("cuDeviceTotalMem"))?,
            l2_bytes: attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            max_shared_per_block: attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize,
            memory_bus_bits: attr(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)? as u32,
        };
        let hopper = hopper_target(info.compute_capability, nvrtc_version().ok());
        let wgmma = config.wgmma && hopper;
        let wide_experts = wgmma && config.wide_experts;
        let wide_projections = wgmma && config.wide_projections;
        let counters = Arc::new(Counters::default());
        let registry = KernelRegistry::new(
            ctx.clone(),
            arch_name(info.compute_capability, hopper),
            config.kernel_cache_dir.clone(),
            config.cuda_include_dir.clone(),
            counters.clone(),
        );
        Ok(Device {
            inner: Arc::new(DeviceInner {
                compute: Stream::new(&ctx, "compute", counters.clone())?,
                copy: Stream::new(&ctx, "copy", counters.clone())?,
                capture: Mutex::new(Stream::new(&ctx, "capture", counters.clone())?),
                ctx,
                info,
                registry,
                counters,
                profiling: AtomicBool::new(config.profile),
                pdl: config.pdl,
                wgmma,
                wide_experts,
                wide_projections,
                fused_attention: config.fused_attention,
                fused_norm: config.fused_norm,
                bounded_router: config.bounded_router,
                decode_split_keys: config.decode_split_keys,
                skinny_experts_from: config.skinny_experts_from,
                dequant_projections_from: config.dequant_projections_from,
                projection_copies: config.projection_copies,
                profile_events: Mutex::new(Vec::new()),
                blas: Mutex::new(None),
                ceilings: OnceLock::new(),
            }),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// The stream kernels run on.
    pub fn compute(&self) -> &Stream {
        &self.inner.compute
    }

    /// The stream for host↔device transfers that overlap with compute; order it against the
    /// compute stream with a [`crate::StageFence`].
    pub fn copy_stream(&self) -> &Stream {
        &self.inner.copy
    }

    pub fn registry(&self) -> &KernelRegistry {
        &self.inner.registry
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    pub(crate) fn counters_ref(&self) -> &Arc<Counters> {
        &self.inner.counters
    }

    /// Runs `f` with the device's cuBLAS handle, creating it on first use, in the process's
    /// turn at cuBLAS (see `blas::calls`).
    pub(crate) fn with_blas<R>(&self, f: impl FnOnce(&Blas) -> Result<R>) -> Result<R> {
        let turn = crate::blas::calls();
        self.with_blas_in_turn(&turn, f)
    }

    /// [`Device::with_blas`] for a caller that holds the turn already (a capture holds it
    /// from its start to its end).
    pub(crate) fn with_blas_in_turn<R>(
        &self,
        _turn: &MutexGuard<'static, ()>,
        f: impl FnOnce(&Blas) -> Result<R>,
    ) -> Result<R> {
        let mut guard = self.inner.blas.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            let alloc = |bytes| self.alloc(DType::U8, bytes);
            *guard = Some(Blas::new(&self.inner.ctx, &self.inner.counters, alloc)?);
        }
        f(guard.as_ref().expect("created above"))
    }

    /// `c[m, n] = a[m, k] · b[k, n]`, row-major f32, through cuBLAS on the compute stream
    /// (asynchronous).
    pub fn matmul_f32(&self, a: &Buffer, b: &Buffer, c: &Buffer, mnk: (usize, usize, usize)) -> Result<()> {
        self.with_blas(|blas| blas.matmul_f32(self.compute(), a, b, c, mnk))
    }

    /// The capture stream, held by the caller until its capture has ended (in the process's
    /// turn at cuBLAS, taken first).
    pub(crate) fn capture_stream(&self) -> MutexGuard<'_, Stream> {
        self.inner.capture.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Function `function` of `module`, compiled or loaded on first use.
    pub fn kernel(&self, module: &ModuleSource, function: &str) -> Result<Kernel> {
        self.inner.registry.kernel(module, function)
    }

    /// How many blocks of `kernel` can run at once on the whole device with `block` threads and
    /// `shared_mem` bytes of dynamic shared memory a block: the blocks of one wave.
    pub fn max_active_blocks(&self, kernel: &Kernel, block: u32, shared_mem: u32) -> Result<usize> {
        self.bind()?;
        kernel.ensure_shared_mem(shared_mem)?;
        let mut n = 0i32;
        // SAFETY: a valid function handle of this context (bound above) and a valid out-pointer.
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                kernel.cu_function(),
                block as i32,
                shared_mem as usize,
            )
            .result()
        }
        .map_err(CudaError::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        Ok(n.max(0) as usize * self.info().sm_count as usize)
    }

    /// (free, total) device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        result::mem_get_info().map_err(CudaError::driver("cuMemGetInfo"))
    }

    fn bind(&self) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))
    }

    /// A zeroed buffer of `dtype` and `shape`. Out of memory is an error that says how much was
    /// asked for and how much is free; the device stays usable.
    pub fn alloc(&self, dtype: DType, shape: impl Into<Shape>) -> Result<Buffer> {
        let shape = shape.into();
        let bytes = shape.elem_count() * dtype.size_in_bytes();
        let alloc = Allocation::new(&self.inner.ctx, bytes)?;
        let buf = Buffer::whole(alloc, dtype, shape);
        // Zero on the compute stream, and make the copy stream wait for it, so no stream of
        // this device can observe the memory before it is zeroed. No host synchronisation.
        let compute = &self.inner.compute;
        // SAFETY: the allocation is live and holds `bytes` bytes.
        unsafe { result::memset_d8_async(buf.device_ptr(), 0, bytes, compute.cu()) }
            .map_err(compute.map_err("cuMemsetD8Async"))?;
        let zeroed = compute.record_event(None)?;
        self.inner.copy.wait_event(&zeroed)?;
        Ok(buf)
    }

    /// A buffer holding `data`.
    pub fn alloc_from<T: HostType>(&self, data: &[T], shape: impl Into<Shape>) -> Result<Buffer> {
        let shape = shape.into();
        if shape.elem_count() != data.len() {
            return Err(kestrel_core::CoreError::ShapeMismatch {
                shape: shape.dims().to_vec(),
                elems: shape.elem_count(),
                expected: data.len(),
            }
            .into());
        }
        let buf = self.alloc(T::DTYPE, shape)?;
        self.upload(&buf, data)?;
        Ok(buf)
    }

    /// `len` zeroed elements of page-locked host memory.
    pub fn pinned<T: HostType>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        PinnedBuffer::new(&self.inner.ctx, len)
    }

    /// Copies `src` into the start of `dst` on the compute stream; see [`Stream::upload`].
    pub fn upload<T: HostType>(&self, dst: &Buffer, src: &[T]) -> Result<()> {
        self.inner.compute.upload(dst, src)
    }

    /// Reads a whole view back after all compute work before it.
    pub fn download<T: HostType>(&self, src: &Buffer) -> Result<Vec<T>> {
        self.inner.compute.download(src)
    }

    /// Blocks until all work on both streams has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.compute.synchronize()?;
        self.inner.copy.synchronize()
    }

    /// Runs `list` eagerly on the compute stream: one launch per dispatch, in order.
    pub fn run(&self, list: &CommandList) -> Result<()> {
        self.run_on(&self.inner.compute, list)
    }

    /// Runs `list` eagerly on `stream`.
    pub fn run_on(&self, stream: &Stream, list: &CommandList) -> Result<()> {
        self.bind()?;
        let profiling = self.inner.profiling.load(Ordering::Relaxed);
        for command in list.commands() {
            let start = if profiling {
                Some(stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
            } else {
                None
            };
            let kernel_name = match command {
                Command::Launch(d) => {
                    self.launch(stream, list.label(), d)?;
                    format!("{}::{}", d.kernel.module(), d.kernel.name())
                }
                Command::Gemm(g) => {
                    // SAFETY: the list holds the three buffers, sized by the encoder for m, n, k.
                    self.with_blas(|blas| unsafe { blas.gemm_bf16(stream.cu(), g) })?;
                    "cublas::gemm_bf16".to_string()
                }
            };
            if let Some(start) = start {
                let end = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
                self.inner
                    .profile_events
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((command.label().to_string(), kernel_name, start, end));
            }
        }
        self.inner.counters.add_dispatches(list.len() as u64);
        stream.end_submission(list.label())
    }

    fn launch(&self, stream: &Stream, submission: &str, d: &crate::command::Dispatch) -> Result<()> {
        d.kernel.ensure_shared_mem(d.shared_mem)?;
        let mut params = d.params();
        let mut ptrs = params.pointers();
        // SAFETY: `ptrs` holds one pointer per kernel parameter, in order, each to a word holding
        // the value (the driver reads the parameter's size from it); buffers named by the
        // dispatch stay allocated because the list holds them; the driver copies the parameters
        // before returning.
        let launched = unsafe {
            sys::cuLaunchKernel(
                d.kernel.cu_function(),
                d.grid.0,
                d.grid.1,
                d.grid.2,
                d.block.0,
                d.block.1,
                d.block.2,
                d.shared_mem,
                stream.cu(),
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        };
        launched.map_err(|e| {
            // A sticky error comes from earlier work: attribute it to that submission.
            if crate::error::is_sticky(&e) {
                stream.map_err("cuLaunchKernel")(e)
            } else {
                CudaError::Launch {
                    submission: submission.to_string(),
                    dispatch: d.label.clone(),
                    kernel: d.kernel.name().to_string(),
                    detail: d.describe_launch(),
                    source: e,
                }
            }
        })
    }

    /// Whether graphs link programmatic dispatches by programmatic edges.
    pub fn pdl(&self) -> bool {
        self.inner.pdl
    }

    /// Whether tensor-core GEMM tiles run on Hopper's `wgmma` (the `_wg` kernels of `gemm.cu`,
    /// built for sm_90a, which needs NVRTC 12 or newer) rather than on `mma.sync`.
    pub fn wgmma(&self) -> bool {
        self.inner.wgmma
    }

    /// Whether routed experts of a few to a few dozen rows each run on the wgmma form of the
    /// skinny products (`moe_wide_*` in `skinny.cu`; only where `wgmma` is on).
    pub fn wide_experts(&self) -> bool {
        self.inner.wide_experts
    }

    /// Whether quantised projections of a few dozen tokens run on the wgmma form of the skinny
    /// products (`linear_wide_*` in `skinny.cu`; only where `wgmma` is on).
    pub fn wide_projections(&self) -> bool {
        self.inner.wide_projections
    }

    /// Whether one token's attention inputs may run inside its decode attention kernel
    /// (`decode_attention_inputs_*` in `attention.cu`).
    pub fn fused_attention(&self) -> bool {
        self.inner.fused_attention
    }

    /// Whether one token's RMS norm may run inside the quantised product that reads it
    /// (`matvec_norm_*_dp4a` in `linear.cu`).
    pub fn fused_norm(&self) -> bool {
        self.inner.fused_norm
    }

    /// Whether a router's logits of many tokens are estimated with a bound first and computed
    /// exactly only for the experts that can be chosen (`router_bounds_*`, `router_choose_*`).
    pub fn bounded_router(&self) -> bool {
        self.inner.bounded_router
    }

    /// The fewest cached keys a block of `decode_attention_*` takes (0: the context spread over
    /// one wave of blocks).
    pub fn decode_split_keys(&self) -> usize {
        self.inner.decode_split_keys
    }

    /// The fewest tokens whose quantised projections are dequantised to bf16 and multiplied by
    /// cuBLAS rather than on the skinny products or the quantised GEMM tiles (0: never).
    pub fn dequant_projections_from(&self) -> usize {
        self.inner.dequant_projections_from
    }

    /// Whether backends keep bf16 copies of the projections that products of many tokens
    /// dequantise, made once, rather than dequantising them at every run.
    pub fn projection_copies(&self) -> bool {
        self.inner.projection_copies
    }

    /// The fewest tokens whose quantised routed experts run on the skinny products, sorted by
    /// expert (fewer take `moe.cu`'s few-token kernels).
    pub fn skinny_experts_from(&self) -> usize {
        self.inner.skinny_experts_from
    }

    /// Turns per-dispatch timing on or off (the configuration sets the initial state).
    pub fn set_profiling(&self, on: bool) {
        self.inner.profiling.store(on, Ordering::Relaxed);
    }

    pub fn is_profiling(&self) -> bool {
        self.inner.profiling.load(Ordering::Relaxed)
    }

    pub(crate) fn push_profile_span(&self, label: String, kernel: String, start: CudaEvent, end: CudaEvent) {
        self.inner
            .profile_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((label, kernel, start, end));
    }

    /// Waits for profiled work and returns the times gathered since the last call.
    pub fn take_profile(&self) -> Result<Profile> {
        let spans = std::mem::take(
            &mut *self
                .inner
                .profile_events
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        let mut profile = Profile::default();
        if !spans.is_empty() {
            self.inner.counters.add_host_syncs(1);
        }
        for (label, kernel, start, end) in spans {
            let ms = start
                .elapsed_ms(&end)
                .map_err(CudaError::driver("cuEventElapsedTime"))?;
            profile.record(&label, &kernel, ms as f64 * 1000.0);
        }
        Ok(profile)
    }

    pub fn counters(&self) -> CounterSnapshot {
        self.inner.counters.snapshot()
    }

    /// What this device can do at best (copy bandwidth, bf16 GEMM rate), the denominators of
    /// every floor: from the table of devices measured by the project, else measured now (a
    /// fraction of a second) and kept.
    pub fn ceilings(&self) -> Result<Ceilings> {
        if let Some(c) = self.inner.ceilings.get() {
            return Ok(*c);
        }
        let c = match ceilings::known(&self.inner.info.name) {
            Some(c) => c,
            None => self.measure_ceilings()?,
        };
        Ok(*self.inner.ceilings.get_or_init(|| c))
    }

    /// Measures the ceilings: a 256 MiB copy and a 4096³ bf16 GEMM through cuBLAS, medians of
    /// five after a warm-up, timed with CUDA events.
    fn measure_ceilings(&self) -> Result<Ceilings> {
        let s = self.compute();
        let median_ms = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            f()?;
            s.synchronize()?;
            let timer = self.timer()?;
            let mut samples = Vec::with_capacity(5);
            for _ in 0..5 {
                timer.start(s)?;
                f()?;
                timer.stop(s)?;
                samples.push(timer.elapsed_ms()?);
            }
            samples.sort_by(f64::total_cmp);
            Ok(samples[samples.len() / 2])
        };
        let bytes = 256 << 20;
        let (src, dst) = (self.alloc(DType::U8, bytes)?, self.alloc(DType::U8, bytes)?);
        let copy_ms = median_ms(&|| s.copy(&dst, &src))?;
        let n = 4096;
        let a = self.alloc(DType::BF16, [n, n])?;
        let b = self.alloc(DType::BF16, [n, n])?;
        let c = self.alloc(DType::F32, [n, n])?;
        let mut list = CommandList::new("ceilings");
        list.gemm_bf16(&a, &b, &c, n, n, n);
        let gemm_ms = median_ms(&|| self.run(&list))?;
        Ok(Ceilings {
            copy_bytes_per_s: 2.0 * bytes as f64 / (copy_ms * 1e-3),
            bf16_flops_per_s: 2.0 * (n * n * n) as f64 / (gemm_ms * 1e-3),
            source: "measured",
        })
    }

    pub fn reset_counters(&self) {
        self.inner.counters.reset()
    }

    /// A pair of timing events for measuring a region on a stream.
    pub fn timer(&self) -> Result<Timer> {
        let ev = || {
            self.inner
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(CudaError::driver("cuEventCreate"))
        };
        Ok(Timer {
            start: ev()?,
            end: ev()?,
            counters: self.inner.counters.clone(),
        })
    }
}

/// Times a region of GPU work with two CUDA events.
pub struct Timer {
    start: CudaEvent,
    end: CudaEvent,
    counters: Arc<Counters>,
}

impl Timer {
    pub fn start(&self, stream: &Stream) -> Result<()> {
        self.start
            .record(stream.raw())
            .map_err(CudaError::driver("cuEventRecord"))
    }

    pub fn stop(&self, stream: &Stream) -> Result<()> {
        self.end
            .record(stream.raw())
            .map_err(CudaError::driver("cuEventRecord"))
    }

    /// Waits for the end event and returns the elapsed GPU time in milliseconds.
    pub fn elapsed_ms(&self) -> Result<f64> {
        self.counters.add_host_syncs(1);
        let ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(CudaError::driver("cuEventElapsedTime"))?;
        Ok(ms as f64)
    }
}
