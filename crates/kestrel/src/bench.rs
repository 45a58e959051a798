//! `kestrel bench`: a model's tokens/s by default (see `bench_model`); `kestrel bench runtime`:
//! launch cost eagerly and as graph replay, device copy bandwidth, and host-to-device bandwidth
//! from pinned and pageable memory; `kestrel bench ops`: the hot ops at real shapes. Runtime and
//! op figures are medians of repeated runs after a warm-up, timed with CUDA events.

use std::process::ExitCode;

use anyhow::{ensure, Context, Result};
use clap::{Args, Subcommand};
use kestrel_core::{Config, DType};
use kestrel_cuda::{device_count, CommandList, Device, Stream, RUNTIME_MODULE};

use crate::stats::median;

/// `kestrel bench`: a model (the default, see `bench_model`) or one of the subcommands.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: Option<BenchCommand>,
    #[command(flatten)]
    model: crate::bench_model::ModelBenchArgs,
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Launch cost, device copy and host-to-device bandwidth.
    Runtime {
        /// Timed repetitions per measurement (the median is reported).
        #[arg(short = 'r', long, default_value_t = 20)]
        reps: usize,
        /// Dispatches in the launch-cost chain.
        #[arg(long, default_value_t = 500)]
        chain: usize,
        /// Size of each copy, in MiB.
        #[arg(long, default_value_t = 1024)]
        copy_mib: usize,
        /// Device ordinal (default: the configured one).
        #[arg(long)]
        device: Option<usize>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A load generator for an OpenAI-compatible server (`kestrel serve`, started here unless
    /// `--url` names one): concurrent streamed requests, throughput and latencies.
    Serve(crate::bench_serve::ServeBenchArgs),
    /// The hot ops at real model shapes (4-bit lm_head matvec, MoE decode, decode attention).
    Ops {
        /// Timed repetitions per measurement (the median is reported).
        #[arg(short = 'r', long, default_value_t = 50)]
        reps: usize,
        /// Also run each op eagerly with every dispatch timed and print the per-kernel table
        /// (to stderr).
        #[arg(long)]
        profile: bool,
        /// Only the ops whose name contains this text (e.g. "attention").
        #[arg(long)]
        only: Option<String>,
        /// Device ordinal (default: the configured one).
        #[arg(long)]
        device: Option<usize>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn open_device(config: &Config, device: Option<usize>) -> Result<Device> {
    let ordinal = device.unwrap_or(config.device);
    let count = device_count().context("benchmarks need a CUDA device")?;
    ensure!(
        ordinal < count,
        "CUDA device {ordinal} not found ({count} present)"
    );
    Ok(Device::open(ordinal, config)?)
}

struct Row {
    name: &'static str,
    value: f64,
    unit: &'static str,
    note: String,
}

pub fn run(config: &Config, args: BenchArgs) -> Result<ExitCode> {
    let Some(what) = args.what else {
        return crate::bench_model::run(config, args.model);
    };
    let (reps, chain, copy_mib, device, json) = match what {
        BenchCommand::Runtime {
            reps,
            chain,
            copy_mib,
            device,
            json,
        } => (reps, chain, copy_mib, device, json),
        BenchCommand::Ops {
            reps,
            profile,
            only,
            device,
            json,
        } => return ops(config, reps, profile, only.as_deref(), device, json),
        BenchCommand::Serve(a) => return crate::bench_serve::run(a),
    };
    ensure!(
        reps >= 1 && chain >= 1 && copy_mib >= 1,
        "--reps, --chain and --copy-mib must be at least 1"
    );
    let dev = open_device(config, device)?;
    let rows = runtime(&dev, reps, chain, copy_mib << 20)?;
    if json {
        let obj: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|r| {
                (
                    r.name.to_string(),
                    serde_json::json!({ "value": r.value, "unit": r.unit, "note": r.note }),
                )
            })
            .collect();
        let out = serde_json::json!({
            "device": dev.info().name,
            "reps": reps,
            "chain": chain,
            "copy_bytes": copy_mib << 20,
            "results": obj,
        });
        outln!("{out}")?;
    } else {
        outln!(
            "device: {} | median of {reps} runs after warm-up | CUDA events",
            dev.info().name
        )?;
        outln!("{:<28} {:>12} {:<8} note", "measurement", "median", "unit")?;
        for r in &rows {
            outln!("{:<28} {:>12.3} {:<8} {}", r.name, r.value, r.unit, r.note)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn ops(
    config: &Config,
    reps: usize,
    profile: bool,
    only: Option<&str>,
    device: Option<usize>,
    json: bool,
) -> Result<ExitCode> {
    ensure!(reps >= 1, "--reps must be at least 1");
    let dev = open_device(config, device)?;
    let rows = crate::bench_ops::run(&dev, reps, profile, only)?;
    ensure!(!rows.is_empty(), "no op's name contains {:?}", only.unwrap_or(""));
    if json {
        let results: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|r| {
                let v = serde_json::json!({ "median_us": r.median_us, "rate": r.rate, "unit": r.unit, "of_floor": r.of_floor, "target": r.target });
                (r.name.clone(), v)
            })
            .collect();
        outln!(
            "{}",
            serde_json::json!({ "device": dev.info().name, "reps": reps, "results": results })
        )?;
    } else {
        outln!(
            "device: {} | median of {reps} graph replays after warm-up | CUDA events",
            dev.info().name
        )?;
        outln!(
            "{:<36} {:>10} {:>12} {:>8}  target",
            "op",
            "median us",
            "rate",
            "floor"
        )?;
        for r in &rows {
            let floor = r
                .of_floor
                .map(|f| format!("{:.1}%", 100.0 * f))
                .unwrap_or_default();
            outln!(
                "{:<36} {:>10.2} {:>7.0} {:<4} {:>8}  {}",
                r.name,
                r.median_us,
                r.rate,
                r.unit,
                floor,
                r.target
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Median GPU time in ms of `f` on `stream`, after one warm-up call.
fn time_median(dev: &Device, stream: &Stream, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    stream.synchronize()?;
    let timer = dev.timer()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        timer.start(stream)?;
        f()?;
        timer.stop(stream)?;
        samples.push(timer.elapsed_ms()?);
    }
    Ok(median(samples))
}

fn runtime(dev: &Device, reps: usize, chain: usize, copy_bytes: usize) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let compute = dev.compute();

    // Launch cost: a chain of dependent one-thread increments, so each waits for the last.
    let counter = dev.alloc(DType::U32, 1)?;
    let inc = dev.kernel(&RUNTIME_MODULE, "increment_u32")?;
    let mut list = CommandList::new("launch-chain");
    for _ in 0..chain {
        list.dispatch(&inc).read_write(&counter).arg(1u32).record();
    }
    let eager_ms = time_median(dev, compute, reps, || Ok(dev.run(&list)?))?;
    let graph = dev.capture(&list)?;
    ensure!(graph.edge_count() == chain - 1, "the chain must be serial");
    let graph_ms = time_median(dev, compute, reps, || Ok(graph.launch()?))?;
    let total = dev.download::<u32>(&counter)?[0] as usize;
    ensure!(total == chain * 2 * (reps + 1), "chain increments lost: {total}");
    rows.push(Row {
        name: "launch eager",
        value: eager_ms * 1e3 / chain as f64,
        unit: "us/disp",
        note: format!("{chain}-kernel dependent chain on one stream"),
    });
    rows.push(Row {
        name: "launch graph replay",
        value: graph_ms * 1e3 / chain as f64,
        unit: "us/node",
        note: "same chain as one CUDA graph; target <= 1.0".to_string(),
    });

    // Device-to-device copy: bytes read plus bytes written.
    let src = dev.alloc(DType::U8, copy_bytes)?;
    let dst = dev.alloc(DType::U8, copy_bytes)?;
    let d2d_ms = time_median(dev, compute, reps, || Ok(compute.copy(&dst, &src)?))?;
    let d2d = 2.0 * copy_bytes as f64 / (d2d_ms * 1e-3);
    rows.push(Row {
        name: "copy d2d",
        value: d2d / 1e9,
        unit: "GB/s",
        note: {
            let c = dev.ceilings()?;
            format!(
                "{:.1}% of the {} ceiling, {:.2} TB/s; target >= 90%",
                100.0 * d2d / c.copy_bytes_per_s,
                c.source,
                c.copy_bytes_per_s / 1e12
            )
        },
    });

    // Host to device, pinned, on the copy stream.
    let copy = dev.copy_stream();
    let pinned = dev.pinned::<u8>(copy_bytes)?;
    let pinned_ms = time_median(dev, copy, reps, || Ok(copy.upload_pinned(&dst, &pinned)?))?;
    rows.push(Row {
        name: "h2d pinned",
        value: copy_bytes as f64 / (pinned_ms * 1e-3) / 1e9,
        unit: "GB/s",
        note: "page-locked source, copy stream; target >= 40".into(),
    });
    let mut back = dev.pinned::<u8>(copy_bytes)?;
    let d2h_ms = time_median(dev, copy, reps, || Ok(copy.download_pinned(&src, &mut back)?))?;
    rows.push(Row {
        name: "d2h pinned",
        value: copy_bytes as f64 / (d2h_ms * 1e-3) / 1e9,
        unit: "GB/s",
        note: "page-locked destination, copy stream".into(),
    });

    // Host to device from ordinary (pageable) memory: the driver stages it.
    let pageable = vec![1u8; copy_bytes];
    let pageable_ms = time_median(dev, compute, reps, || Ok(compute.upload(&dst, &pageable)?))?;
    rows.push(Row {
        name: "h2d pageable",
        value: copy_bytes as f64 / (pageable_ms * 1e-3) / 1e9,
        unit: "GB/s",
        note: "ordinary Vec<u8> source".into(),
    });
    dev.synchronize()?;
    Ok(rows)
}
