//! `kestrel doctor`: what CUDA set-up this machine has, and whether Kestrel's kernels compile,
//! run and compute the right numbers on each device.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use kestrel_core::{rng::Rng, Config, DType};
use kestrel_cuda::{device_count, CommandList, CudaError, Device, LoadOrigin, MODULES, RUNTIME_MODULE};

/// Every kernel module as NVRTC is given it: name, `-D` definitions and in-memory headers, one
/// JSON object (for `scripts/gpu/nvrtc-check.py`, which compiles them without a GPU).
pub fn kernel_options() -> Result<ExitCode> {
    let modules: Vec<serde_json::Value> = std::iter::once(&RUNTIME_MODULE)
        .chain(MODULES)
        .map(|m| {
            let defines: Vec<String> = m.defines.iter().map(|(n, v)| format!("-D{n}={v}")).collect();
            let headers: Vec<&str> = m.headers.iter().map(|(n, _)| *n).collect();
            serde_json::json!({"name": m.name, "defines": defines, "headers": headers})
        })
        .collect();
    outln!("{}", serde_json::json!({ "modules": modules }))?;
    Ok(ExitCode::SUCCESS)
}

pub fn run(config: &Config, only: Option<usize>) -> Result<ExitCode> {
    outln!("kestrel {}", env!("CARGO_PKG_VERSION"))?;
    for p in &config.problems {
        outln!(
            "configuration: {}={:?} is invalid ({}); CUDA runs stop until it is fixed or unset",
            p.var,
            p.value,
            p.reason
        )?;
    }
    let count = match device_count() {
        Ok(n) => n,
        Err(CudaError::NoDriver(lib)) => {
            outln!("No CUDA driver found ({lib} could not be loaded): no GPU was found.")?;
            outln!("Kestrel will run on the CPU backend.")?;
            return Ok(ExitCode::SUCCESS);
        }
        Err(e) => return Err(e).context("querying CUDA devices"),
    };
    if count == 0 {
        outln!("The CUDA driver is installed but reports no device: no GPU was found.")?;
        outln!("Kestrel will run on the CPU backend.")?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{count} CUDA device(s)")?;
    match &config.kernel_cache_dir {
        Some(dir) => outln!("kernel cache: {}", dir.display())?,
        None => outln!("kernel cache: off")?,
    }
    match &config.cuda_include_dir {
        Some(dir) => outln!("CUDA headers: {}", dir.display())?,
        None => outln!("CUDA headers: NVRTC built-ins")?,
    }
    let mut failed = false;
    for ordinal in (0..count).filter(|o| only.is_none_or(|d| d == *o)) {
        match check_device(config, ordinal) {
            Ok(()) => outln!("device {ordinal}: OK")?,
            Err(e) => {
                failed = true;
                outln!("device {ordinal}: FAILED: {e:#}")?;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn check_device(config: &Config, ordinal: usize) -> Result<()> {
    let dev = Device::open(ordinal, config)?;
    let info = dev.info();
    let (free, total) = dev.memory_info()?;
    outln!(
        "device {ordinal}: {} | compute capability {}.{} | {} SMs | {:.1} GiB ({:.1} GiB free) | L2 {} MiB",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.sm_count,
        total as f64 / (1u64 << 30) as f64,
        free as f64 / (1u64 << 30) as f64,
        info.l2_bytes >> 20,
    )?;

    // Every module, with the options the backend compiles it with.
    let t = Instant::now();
    let all: Vec<_> = std::iter::once(RUNTIME_MODULE)
        .chain(MODULES.iter().copied())
        .collect();
    let origins = dev.registry().load_modules(&all)?;
    let compiled = origins.iter().filter(|&&o| o == LoadOrigin::Compiled).count();
    let cached = origins.len() - compiled;
    outln!(
        "  kernels for {}: {} modules, {compiled} compiled by NVRTC, {cached} from the kernel cache, in {:.0} ms",
        dev.registry().arch(),
        compiled + cached,
        t.elapsed().as_secs_f64() * 1e3
    )?;

    // axpy and a bf16 round trip on a size that is not a multiple of the block.
    let (mut rng, _) = Rng::from_time();
    let n = 1_000_003;
    let x: Vec<f32> = (0..n).map(|_| rng.symmetric()).collect();
    let y: Vec<f32> = (0..n).map(|_| rng.symmetric()).collect();
    let a = rng.symmetric();
    let (xb, yb) = (dev.alloc_from(&x, n)?, dev.alloc_from(&y, n)?);
    let bf = dev.alloc_from(&vec![f32::NAN; n], n)?;
    let mut list = CommandList::new("doctor");
    list.dispatch(&dev.kernel(&RUNTIME_MODULE, "axpy_f32")?)
        .cover(n, 256)
        .read(&xb)
        .read_write(&yb)
        .arg(a)
        .arg(n as u32)
        .record();
    list.dispatch(&dev.kernel(&RUNTIME_MODULE, "round_bf16_f32")?)
        .cover(n, 256)
        .read(&xb)
        .write(&bf)
        .arg(n as u32)
        .record();
    dev.run(&list)?;
    let got = dev.download::<f32>(&yb)?;
    let bad = (0..n).filter(|&i| got[i] != a.mul_add(x[i], y[i])).count();
    ensure!(bad == 0, "axpy_f32 differs from the CPU in {bad} of {n} elements");
    let got = dev.download::<f32>(&bf)?;
    let bad = (0..n)
        .filter(|&i| got[i] != half::bf16::from_f32(x[i]).to_f32())
        .count();
    ensure!(
        bad == 0,
        "round_bf16_f32 differs from the CPU in {bad} of {n} elements"
    );
    outln!("  axpy_f32 and round_bf16_f32 on {n} elements: exact match with the CPU")?;

    let (m, k, nn) = (67, 45, 33);
    let a: Vec<f32> = (0..m * k).map(|_| rng.symmetric()).collect();
    let b: Vec<f32> = (0..k * nn).map(|_| rng.symmetric()).collect();
    let (ab, bb) = (dev.alloc_from(&a, m * k)?, dev.alloc_from(&b, k * nn)?);
    let cb = dev.alloc(DType::F32, m * nn)?;
    dev.matmul_f32(&ab, &bb, &cb, (m, nn, k))?;
    let c = dev.download::<f32>(&cb)?;
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..nn {
            let r: f64 = (0..k).map(|p| a[i * k + p] as f64 * b[p * nn + j] as f64).sum();
            worst = worst.max((c[i * nn + j] as f64 - r).abs());
        }
    }
    ensure!(worst < 1e-4, "cuBLAS sgemm max error {worst:e}");
    outln!("  cuBLAS sgemm {m}x{k}x{nn}: max error {worst:.1e}")?;
    Ok(())
}
