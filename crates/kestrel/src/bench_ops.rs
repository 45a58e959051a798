//! `kestrel bench ops`: the hot ops of MoE inference at real model shapes, each prepared as a
//! one-op graph on the CUDA backend, replayed as a CUDA graph and timed with CUDA events (median
//! of repeated runs after a warm-up), next to its floor: bytes over the measured 4.26 TB/s, or
//! FLOPs over the bf16 tensor-core rate.

use anyhow::Result;
use half::bf16;
use kestrel_core::ir::{BufId, ExpertFormat, ExpertLayout, Role};
use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_core::{Backend, DType, GraphBuilder};
use kestrel_cuda::{CudaBackend, CudaProgram, Device, RunMode};

use crate::bench::median;

/// Device-to-device copy bandwidth measured on the H200 (bytes read plus written).
pub const COPY_BYTES_PER_S: f64 = 4.26e12;

pub struct OpRow {
    pub name: String,
    pub median_us: f64,
    /// The figure the target is stated in: GB/s or TFLOP/s.
    pub rate: f64,
    pub unit: &'static str,
    /// `rate` as a fraction of its ceiling, when the ceiling is bandwidth.
    pub of_floor: Option<f64>,
    pub target: &'static str,
}

/// Random contents for every weight, state and input of a prepared program.
fn fill_random(cuda: &mut CudaBackend, p: &mut CudaProgram, rng: &mut Rng) -> Result<()> {
    let decls: Vec<_> = CudaBackend::graph(p).bufs.iter().cloned().enumerate().collect();
    for (i, d) in decls {
        let n = d.elem_count();
        let buf = kestrel_core::ir::Buf(i as u32);
        match d.dtype {
            DType::F32 => cuda.upload(
                p,
                buf,
                &(0..n).map(|_| rng.symmetric() * 0.5).collect::<Vec<f32>>(),
            )?,
            DType::BF16 => cuda.upload(
                p,
                buf,
                &(0..n)
                    .map(|_| bf16::from_f32(rng.symmetric() * 0.05))
                    .collect::<Vec<_>>(),
            )?,
            DType::U32 => cuda.upload(
                p,
                buf,
                &(0..n).map(|_| rng.next_u64() as u32).collect::<Vec<u32>>(),
            )?,
            DType::U8 => cuda.upload(p, buf, &(0..n).map(|_| rng.next_u64() as u8).collect::<Vec<u8>>())?,
            _ => {}
        }
    }
    Ok(())
}

/// Replays before timing: at least this long, so the GPU leaves its idle clocks (it idles at a
/// fraction of its boost clock and takes tens of milliseconds of load to ramp up).
const WARM_UP: std::time::Duration = std::time::Duration::from_millis(300);

/// Median microseconds of one replay of `p`.
fn time_program(dev: &Device, cuda: &mut CudaBackend, p: &mut CudaProgram, reps: usize) -> Result<f64> {
    let start = std::time::Instant::now();
    while start.elapsed() < WARM_UP {
        for _ in 0..50 {
            cuda.run(p)?;
        }
        dev.synchronize()?;
    }
    let timer = dev.timer()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        timer.start(dev.compute())?;
        cuda.run(p)?;
        timer.stop(dev.compute())?;
        samples.push(timer.elapsed_ms()? * 1e3);
    }
    Ok(median(samples))
}

/// Per-kernel GPU times of `graph` run eagerly with every dispatch timed by CUDA events.
fn kernel_breakdown(
    dev: &Device,
    graph: &kestrel_core::ir::Graph,
    rng: &mut Rng,
    reps: usize,
) -> Result<String> {
    let mut cuda = CudaBackend::new(dev.clone(), RunMode::Eager);
    let mut p = cuda.prepare(graph)?;
    fill_random(&mut cuda, &mut p, rng)?;
    time_program(dev, &mut cuda, &mut p, 1)?;
    dev.take_profile()?;
    dev.set_profiling(true);
    for _ in 0..reps {
        cuda.run(&mut p)?;
    }
    dev.set_profiling(false);
    Ok(dev.take_profile()?.table())
}

fn mark<R: Role>(g: &mut GraphBuilder, id: BufId<R>) {
    g.mark_output(id);
}

pub fn run(dev: &Device, reps: usize, profile: bool) -> Result<Vec<OpRow>> {
    let mut rows = Vec::new();
    let mut rng = Rng::new(0x5EED);

    // 4-bit matvec at the lm_head shape: 2048 -> 151,936, one token.
    {
        let (inp, out) = (2048, 151_936);
        let q = QuantFormat::Q4;
        let mut g = GraphBuilder::new();
        let x = g.act_input("x", 1, inp);
        let w = g.quant_weight("lm_head", out, inp, q);
        let y = g.linear("lm_head", x, &w);
        mark(&mut g, y);
        let graph = g.finish()?;
        let mut cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
        let mut p = cuda.prepare(&graph)?;
        fill_random(&mut cuda, &mut p, &mut rng)?;
        let us = time_program(dev, &mut cuda, &mut p, reps)?;
        if profile {
            eprintln!("{}", kernel_breakdown(dev, &graph, &mut rng, reps)?);
        }
        let bytes = q.bytes(out, inp) as f64;
        let gbs = bytes / (us * 1e-6) / 1e9;
        rows.push(OpRow {
            name: "q4 matvec 2048->151936".into(),
            median_us: us,
            rate: gbs,
            unit: "GB/s",
            of_floor: Some(gbs * 1e9 / COPY_BYTES_PER_S),
            target: ">= 80% of 4.26 TB/s",
        });
    }

    // MoE decode: one token, router over 128 experts, top-8, hidden 2048, expert width 768, 4-bit.
    {
        let (hidden, inter, experts, k) = (2048, 768, 128, 8);
        let layout = ExpertLayout {
            experts,
            hidden,
            inter,
            format: ExpertFormat::Quant(QuantFormat::Q4),
        };
        let mut g = GraphBuilder::new();
        let x = g.act_input("x", 1, hidden);
        let logits = g.act_input("router_logits", 1, experts);
        let (ids, w) = g.router("router", logits, k, true);
        let e = g.weight("experts", DType::U8, [layout.total_bytes()]);
        let y = g.moe_experts("experts", x, ids, w, e, layout);
        mark(&mut g, y);
        let graph = g.finish()?;
        let mut cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
        let mut p = cuda.prepare(&graph)?;
        fill_random(&mut cuda, &mut p, &mut rng)?;
        let us = time_program(dev, &mut cuda, &mut p, reps)?;
        if profile {
            eprintln!("{}", kernel_breakdown(dev, &graph, &mut rng, reps)?);
        }
        let q = QuantFormat::Q4;
        let bytes = (k * (2 * q.bytes(inter, hidden) + q.bytes(hidden, inter))) as f64;
        let gbs = bytes / (us * 1e-6) / 1e9;
        rows.push(OpRow {
            name: "moe decode top-8/128 q4".into(),
            median_us: us,
            rate: gbs,
            unit: "GB/s",
            of_floor: Some(gbs * 1e9 / COPY_BYTES_PER_S),
            target: ">= 60% of 4.26 TB/s (selected experts' bytes)",
        });
    }

    // Decode attention at 8k context: 32 query heads, 4 KV heads, head dim 128, bf16 cache.
    {
        let (heads, kv_heads, hd, ctx) = (32, 4, 128, 8192);
        let mut g = GraphBuilder::new();
        let q = g.act_input("q", 1, heads * hd);
        let kc = g.cache("k_cache", DType::BF16, kv_heads, ctx, hd);
        let vc = g.cache("v_cache", DType::BF16, kv_heads, ctx, hd);
        let pos = g.positions_input("pos", 1);
        let o = g.attention("attention", q, kc, vc, pos, heads, 1.0 / (hd as f32).sqrt());
        mark(&mut g, o);
        let graph = g.finish()?;
        let mut cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
        let mut p = cuda.prepare(&graph)?;
        fill_random(&mut cuda, &mut p, &mut rng)?;
        cuda.upload(&mut p, pos, &[(ctx - 1) as u32])?;
        let us = time_program(dev, &mut cuda, &mut p, reps)?;
        if profile {
            eprintln!("{}", kernel_breakdown(dev, &graph, &mut rng, reps)?);
        }
        let bytes = (2 * kv_heads * ctx * hd * 2) as f64;
        let gbs = bytes / (us * 1e-6) / 1e9;
        rows.push(OpRow {
            name: "attention decode ctx 8192".into(),
            median_us: us,
            rate: gbs,
            unit: "GB/s",
            of_floor: Some(gbs * 1e9 / COPY_BYTES_PER_S),
            target: ">= 60% of 4.26 TB/s (KV bytes read)",
        });
    }
    Ok(rows)
}
