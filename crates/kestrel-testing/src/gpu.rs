//! Helpers for GPU tests: open the configured device or skip with a printed notice, and fail
//! instead of skipping when `KESTREL_REQUIRE_GPU` is set.

use std::io::Write;

use kestrel_core::{Config, TestSwitches};
use kestrel_cuda_rt::{device_count, Device};

/// Whether `KESTREL_REQUIRE_GPU` asks for a missing device to fail GPU tests.
///
/// # Panics
/// When the test switches in the environment are invalid (the run is misconfigured).
pub fn require_gpu() -> bool {
    TestSwitches::from_env()
        .expect("invalid Kestrel test switches in the environment")
        .require_gpu
}

/// The configured device, or `None` after printing why the test is skipped.
///
/// # Panics
/// When no device is present and `KESTREL_REQUIRE_GPU` is set (a test failure is the point), or
/// when the configuration itself is invalid.
pub fn device_or_skip(test: &str) -> Option<Device> {
    let config = Config::from_env();
    if let Err(e) = config.check() {
        panic!("{test}: invalid Kestrel configuration in the environment: {e}");
    }
    match device_count() {
        Ok(n) if n > config.device => Some(
            Device::open(config.device, &config)
                .unwrap_or_else(|e| panic!("{test}: opening device {}: {e}", config.device)),
        ),
        outcome => {
            let why = match outcome {
                Ok(n) => format!("{n} CUDA device(s), none with ordinal {}", config.device),
                Err(e) => e.to_string(),
            };
            if require_gpu() {
                panic!("{test}: KESTREL_REQUIRE_GPU is set but no usable CUDA device: {why}");
            }
            // Written to the process's stderr directly: the test harness captures `println!`
            // of passing tests, and a skip must be visible.
            let _ = writeln!(
                std::io::stderr(),
                "skipping {test}: no CUDA device ({why}); set KESTREL_REQUIRE_GPU=1 to fail instead"
            );
            None
        }
    }
}

/// `dev`, and where it runs GEMM tiles on `wgmma`, the same GPU opened again with `wgmma` off:
/// the devices a test runs on so that both tensor-core engines of `gemm.cu` are checked.
///
/// # Panics
/// When the second device cannot be opened (a test failure is the point).
pub fn tensor_engines(dev: &Device) -> Vec<Device> {
    let mut devices = vec![dev.clone()];
    if dev.wgmma() {
        let mut config = Config::from_env();
        config.wgmma = false;
        let ordinal = dev.info().ordinal;
        devices.push(
            Device::open(ordinal, &config)
                .unwrap_or_else(|e| panic!("opening device {ordinal} with wgmma off: {e}")),
        );
    }
    devices
}

/// The GPU `dev` is, opened again with the one-token fusions on (`Config::fused_attention`,
/// `Config::fused_norm`; on by default, but the environment may turn them off), for the tests
/// of the fused kernels.
///
/// # Panics
/// When the device cannot be opened (a test failure is the point).
pub fn with_fusions(dev: &Device) -> Device {
    reopened(dev, "the fusions on", |c| {
        c.fused_attention = true;
        c.fused_norm = true;
    })
}

/// The GPU `dev` is, opened again with the one-token fusions off: the kernels a one-token step
/// runs without them (and GPUs before Hopper run for attention), for the tests that keep those
/// checked too.
///
/// # Panics
/// When the device cannot be opened (a test failure is the point).
pub fn without_fusions(dev: &Device) -> Device {
    reopened(dev, "the fusions off", |c| {
        c.fused_attention = false;
        c.fused_norm = false;
    })
}

/// The GPU `dev` is, opened again with the process configuration as `edit` changes it (`what`
/// names the change in a panic's message).
///
/// # Panics
/// When the device cannot be opened (a test failure is the point).
pub fn reopened(dev: &Device, what: &str, edit: impl FnOnce(&mut Config)) -> Device {
    let mut config = Config::from_env();
    edit(&mut config);
    let ordinal = dev.info().ordinal;
    Device::open(ordinal, &config).unwrap_or_else(|e| panic!("opening device {ordinal} with {what}: {e}"))
}
