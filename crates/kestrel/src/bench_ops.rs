//! `kestrel bench ops`: the hot ops of MoE inference at real model shapes, each prepared as a
//! one-op graph on the CUDA backend, replayed as a CUDA graph and timed with CUDA events (median
//! of repeated runs after a warm-up), next to its floor: bytes over the device's copy bandwidth,
//! or FLOPs over its bf16 tensor-core rate (`Device::ceilings`). Before every timed replay the L2 cache is flushed, so an
//! op whose bytes would fit in L2 (the eight experts of one MoE decode, an 8k KV cache) reads
//! them from memory as it would inside a model, where the other layers' weights pass through L2
//! between two visits.

use anyhow::Result;
use half::bf16;
use kestrel_core::ir::{Buf, BufId, DeltaAlgo, ExpertFormat, ExpertLayout, Graph, KvPages, Role};
use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_core::{Backend, DType, GraphBuilder};
use kestrel_cuda::{CudaBackend, CudaProgram, Device, RunMode, RUNTIME_MODULE};

use crate::stats::median;

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
            // Byte blobs are quantised experts: random words, with every odd byte (the high
            // byte of each bf16 scale and bias) drawn so that any two bytes read as a bf16 are
            // finite, about ±0.008 to ±0.125. Fully random bytes make NaN and infinite scales,
            // so a chain of MoE layers would route on NaN logits from its second layer on.
            DType::U8 => cuda.upload(
                p,
                buf,
                &(0..n)
                    .map(|i| {
                        let r = rng.next_u64() as u8;
                        if i % 2 == 1 {
                            0x3c | (r & 0x81)
                        } else {
                            r
                        }
                    })
                    .collect::<Vec<u8>>(),
            )?,
            _ => {}
        }
    }
    Ok(())
}

/// Replays before timing: at least this long, so the GPU leaves its idle clocks (it idles at a
/// fraction of its boost clock and takes tens of milliseconds of load to ramp up).
const WARM_UP: std::time::Duration = std::time::Duration::from_millis(300);

/// Bytes read before each timed replay to push everything out of L2 (50 MB on an H200). Read,
/// not written: a memset would leave L2 full of dirty lines whose write-backs the op would pay.
const L2_FLUSH_BYTES: usize = 256 << 20;

/// Evicts what L2 holds by reading `L2_FLUSH_BYTES` of other memory (`read_all_u32`).
struct L2Flush {
    data: kestrel_cuda::Buffer,
    sink: kestrel_cuda::Buffer,
    kernel: kestrel_cuda::Kernel,
}

impl L2Flush {
    fn new(dev: &Device) -> Result<Self> {
        Ok(L2Flush {
            data: dev.alloc(DType::U8, L2_FLUSH_BYTES)?,
            sink: dev.alloc(DType::U32, 1)?,
            kernel: dev.kernel(&RUNTIME_MODULE, "read_all_u32")?,
        })
    }

    fn run(&self, dev: &Device) -> Result<()> {
        let mut list = kestrel_cuda::CommandList::new("l2-flush");
        list.dispatch(&self.kernel)
            .grid(4 * dev.info().sm_count)
            .block(512)
            .read(&self.data)
            .write(&self.sink)
            .arg((L2_FLUSH_BYTES / 16) as u64)
            .record();
        Ok(dev.run(&list)?)
    }
}

/// Median microseconds of one replay of `p`, each started with a cold L2.
fn time_program(dev: &Device, cuda: &mut CudaBackend, p: &mut CudaProgram, reps: usize) -> Result<f64> {
    time_cold(dev, reps, || Ok(cuda.run(p)?))
}

/// Median microseconds of `launch` (work enqueued on the compute stream), each run started with a
/// cold L2, after `WARM_UP` of runs.
fn time_cold(dev: &Device, reps: usize, mut launch: impl FnMut() -> Result<()>) -> Result<f64> {
    let flush = L2Flush::new(dev)?;
    let start = std::time::Instant::now();
    while start.elapsed() < WARM_UP {
        for _ in 0..50 {
            launch()?;
        }
        dev.synchronize()?;
    }
    let timer = dev.timer()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        flush.run(dev)?;
        timer.start(dev.compute())?;
        launch()?;
        timer.stop(dev.compute())?;
        samples.push(timer.elapsed_ms()? * 1e3);
    }
    Ok(median(samples))
}

/// One measured op: its graph, the u32 inputs it needs fixed (positions), the bytes it must move.
struct Bench {
    name: &'static str,
    graph: Graph,
    fixed: Vec<(Buf, Vec<u32>)>,
    /// Copies of the op the graph chains (each reading its own weights or cache, so each starts
    /// from memory as a model's layers do); the figures are per op.
    ops: usize,
    /// Bytes one op must move.
    bytes: f64,
    /// Floating-point operations, for ops bound by arithmetic (rate in TFLOP/s against the
    /// measured bf16 rate); None for ops bound by bandwidth.
    flops: Option<f64>,
    target: &'static str,
}

/// A program of `graph` with random contents and the fixed inputs written.
fn prepared(dev: &Device, b: &Bench, mode: RunMode, rng: &mut Rng) -> Result<(CudaBackend, CudaProgram)> {
    let mut cuda = CudaBackend::new(dev.clone(), mode);
    let mut p = cuda.prepare(&b.graph)?;
    fill_random(&mut cuda, &mut p, rng)?;
    for (buf, values) in &b.fixed {
        cuda.upload(&mut p, *buf, values)?;
    }
    Ok((cuda, p))
}

fn measure(dev: &Device, b: &Bench, reps: usize, profile: bool, rng: &mut Rng) -> Result<OpRow> {
    let (mut cuda, mut p) = prepared(dev, b, RunMode::Graph, rng)?;
    let us = time_program(dev, &mut cuda, &mut p, reps)? / b.ops as f64;
    if profile {
        // Eager, every dispatch between two CUDA events.
        let (mut cuda, mut p) = prepared(dev, b, RunMode::Eager, rng)?;
        time_program(dev, &mut cuda, &mut p, 1)?;
        dev.take_profile()?;
        let flush = L2Flush::new(dev)?;
        for _ in 0..reps {
            flush.run(dev)?;
            dev.set_profiling(true);
            cuda.run(&mut p)?;
            dev.set_profiling(false);
        }
        errln!("{}\n{}", b.name, dev.take_profile()?.table());
    }
    if let Some(flops) = b.flops {
        let tflops = flops / (us * 1e-6) / 1e12;
        return Ok(OpRow {
            name: b.name.to_string(),
            median_us: us,
            rate: tflops,
            unit: "TFLOP/s",
            of_floor: Some(tflops * 1e12 / dev.ceilings()?.bf16_flops_per_s),
            target: b.target,
        });
    }
    let gbs = b.bytes / (us * 1e-6) / 1e9;
    Ok(OpRow {
        name: b.name.to_string(),
        median_us: us,
        rate: gbs,
        unit: "GB/s",
        of_floor: Some(gbs * 1e9 / dev.ceilings()?.copy_bytes_per_s),
        target: b.target,
    })
}

/// Reference rows: how long a plain streaming read of `bytes` takes when timed as the ops are (a
/// one-kernel CUDA graph replayed from a cold L2, CUDA events around the launch). For ops of a
/// few tens of MB this is well above bytes over the copy bandwidth: launch, ramp-up and the last loads'
/// latency are paid once per op, so it is the practical floor an op of that size is compared to.
fn measure_read(dev: &Device, name: &str, bytes: usize, reps: usize) -> Result<OpRow> {
    let data = dev.alloc(DType::U8, bytes)?;
    let sink = dev.alloc(DType::U32, 1)?;
    let kernel = dev.kernel(&RUNTIME_MODULE, "read_all_u32")?;
    let mut list = kestrel_cuda::CommandList::new("read");
    list.dispatch(&kernel)
        .grid(4 * dev.info().sm_count)
        .block(512)
        .read(&data)
        .write(&sink)
        .arg((bytes / 16) as u64)
        .record();
    let graph = dev.capture(&list)?;
    let us = time_cold(dev, reps, || Ok(graph.launch()?))?;
    let gbs = bytes as f64 / (us * 1e-6) / 1e9;
    Ok(OpRow {
        name: name.to_string(),
        median_us: us,
        rate: gbs,
        unit: "GB/s",
        of_floor: Some(gbs * 1e9 / dev.ceilings()?.copy_bytes_per_s),
        target: "reference: the same bytes by a plain read",
    })
}

/// Pages of one sequence over caches of `ctx` rows, its blocks in order (as a session lays out
/// one sequence), with the table and sequence id a bench writes.
fn one_sequence(g: &mut GraphBuilder, ctx: usize) -> (KvPages, Vec<(Buf, Vec<u32>)>) {
    let block = kestrel_model::graph::KV_BLOCK;
    let blocks = ctx.div_ceil(block);
    let table = g.page_table_input("kv.table", 1, blocks);
    let seq = g.seq_input("kv.seq", 1);
    let pages = g.kv_pages("kv.pages", table, seq, block);
    (
        pages,
        vec![(table.raw(), (0..blocks as u32).collect()), (seq.raw(), vec![0])],
    )
}

fn finish<R: Role>(mut g: GraphBuilder, out: BufId<R>) -> Result<Graph> {
    g.mark_output(out);
    Ok(g.finish()?)
}

pub fn run(dev: &Device, reps: usize, profile: bool, only: Option<&str>) -> Result<Vec<OpRow>> {
    let mut rng = Rng::new(0x5EED);
    let q4 = QuantFormat::Q4;
    let mut benches = Vec::new();

    // 4-bit matvec at the lm_head shape: 2048 -> 151,936, one token.
    let (inp, out) = (2048, 151_936);
    let mut g = GraphBuilder::new();
    let x = g.act_input("x", 1, inp);
    let w = g.quant_weight("lm_head", out, inp, q4);
    let y = g.linear("lm_head", x, &w);
    benches.push(Bench {
        name: "q4 matvec 2048->151936",
        graph: finish(g, y)?,
        fixed: vec![],
        ops: 1,
        bytes: q4.bytes(out, inp) as f64,
        flops: None,
        target: ">= 80% of copy bandwidth",
    });

    // MoE decode: one token, router over 128 experts, top-8, hidden 2048, expert width 768, 4-bit.
    let (hidden, inter, experts, k) = (2048, 768, 128, 8);
    let layout = ExpertLayout::uniform(experts, hidden, inter, ExpertFormat::Quant(q4));
    let mut g = GraphBuilder::new();
    let x = g.act_input("x", 1, hidden);
    let logits = g.act_input("router_logits", 1, experts);
    let (ids, w) = g.router("router", logits, k, true);
    let e = g.weight("experts", DType::U8, [layout.total_bytes()]);
    let y = g.moe_experts("experts", x, ids, w, e, layout);
    let bytes = (k * (2 * q4.bytes(inter, hidden) + q4.bytes(hidden, inter))) as f64;
    benches.push(Bench {
        name: "moe decode top-8/128 q4",
        graph: finish(g, y)?,
        fixed: vec![],
        ops: 1,
        bytes,
        flops: None,
        target: ">= 60% of copy bandwidth (selected experts' bytes)",
    });

    // The same with the router's product in front (8-bit, as the models quantise routers), as a
    // decode step runs it: x -> logits -> choice -> experts. Bytes: the experts' and the router's.
    let q8 = QuantFormat::Q8;
    let mut g = GraphBuilder::new();
    let x = g.act_input("x", 1, hidden);
    let rw = g.quant_weight("router", experts, hidden, q8);
    let logits = g.linear("router", x, &rw);
    let (ids, w) = g.router("router", logits, k, true);
    let e = g.weight("experts", DType::U8, [layout.total_bytes()]);
    let y = g.moe_experts("experts", x, ids, w, e, layout);
    benches.push(Bench {
        name: "moe decode + q8 router product",
        graph: finish(g, y)?,
        fixed: vec![],
        ops: 1,
        bytes: bytes + q8.bytes(experts, hidden) as f64,
        flops: None,
        target: "none (the model's form of the row above)",
    });

    // Four of the row above in a row, each layer with its own experts and router, as a decode
    // step runs them: the launch of each hides behind the one before.
    let layers = 4;
    let mut g = GraphBuilder::new();
    let mut x = g.act_input("x", 1, hidden);
    for l in 0..layers {
        let rw = g.quant_weight(&format!("router.{l}"), experts, hidden, q8);
        let logits = g.linear(&format!("router.{l}"), x, &rw);
        let (ids, w) = g.router(&format!("router.{l}"), logits, k, true);
        let e = g.weight(&format!("experts.{l}"), DType::U8, [layout.total_bytes()]);
        x = g.moe_experts(&format!("experts.{l}"), x, ids, w, e, layout);
    }
    benches.push(Bench {
        name: "moe decode + q8 router, 4 layers",
        graph: finish(g, x)?,
        fixed: vec![],
        ops: layers,
        bytes: bytes + q8.bytes(experts, hidden) as f64,
        flops: None,
        target: "none (per layer: the op inside a graph)",
    });

    // The same experts for a 4,096-token prefill: router, tokens grouped by expert, grouped
    // GEMMs, combine. FLOPs: 3 products of 2 * hidden * inter per (token, slot).
    let tokens = 4096;
    let mut g = GraphBuilder::new();
    let x = g.act_input("x", tokens, hidden);
    let logits = g.act_input("router_logits", tokens, experts);
    let (ids, w) = g.router("router", logits, k, true);
    let e = g.weight("experts", DType::U8, [layout.total_bytes()]);
    let y = g.moe_experts("experts", x, ids, w, e, layout);
    benches.push(Bench {
        name: "moe prefill 4096 top-8/128 q4",
        graph: finish(g, y)?,
        fixed: vec![],
        ops: 1,
        bytes: 0.0,
        flops: Some((tokens * k * 3 * 2 * hidden * inter) as f64),
        target: ">= 250 TFLOP/s",
    });

    // Decode attention at 8k context: 32 query heads, 4 KV heads, head dim 128, bf16 cache.
    let (heads, kv_heads, hd, ctx) = (32, 4, 128, 8192);
    let mut g = GraphBuilder::new();
    let q = g.act_input("q", 1, heads * hd);
    let (pages, mut fixed) = one_sequence(&mut g, ctx);
    let kc = g.cache("k_cache", DType::BF16, kv_heads, ctx, hd);
    let vc = g.cache("v_cache", DType::BF16, kv_heads, ctx, hd);
    let pos = g.positions_input("pos", 1);
    let o = g.attention(
        "attention",
        q,
        kc,
        vc,
        pos,
        pages,
        heads,
        1.0 / (hd as f32).sqrt(),
    );
    let bytes = (2 * kv_heads * ctx * hd * 2) as f64;
    fixed.push((pos.raw(), vec![(ctx - 1) as u32]));
    benches.push(Bench {
        name: "attention decode ctx 8192",
        graph: finish(g, o)?,
        fixed,
        ops: 1,
        bytes,
        flops: None,
        target: ">= 60% of copy bandwidth (KV bytes read)",
    });

    // Four of them in a row over their own caches (the output of one is the next one's query),
    // as a decode step's layers run them.
    let mut g = GraphBuilder::new();
    let mut q = g.act_input("q", 1, heads * hd);
    let (pages, mut fixed) = one_sequence(&mut g, ctx);
    let pos = g.positions_input("pos", 1);
    fixed.push((pos.raw(), vec![(ctx - 1) as u32]));
    for l in 0..layers {
        let kc = g.cache(&format!("k_cache.{l}"), DType::BF16, kv_heads, ctx, hd);
        let vc = g.cache(&format!("v_cache.{l}"), DType::BF16, kv_heads, ctx, hd);
        q = g.attention(
            &format!("attention.{l}"),
            q,
            kc,
            vc,
            pos,
            pages,
            heads,
            1.0 / (hd as f32).sqrt(),
        );
    }
    benches.push(Bench {
        name: "attention decode ctx 8192, 4 layers",
        graph: finish(g, q)?,
        fixed,
        ops: layers,
        bytes,
        flops: None,
        target: "none (per layer: the op inside a graph)",
    });

    // Causal prefill attention: 4,096 tokens from position 0, same heads, bf16 cache. FLOPs:
    // QK^T and PV over the (t + 1) visible keys of each token, 2 * 2 * head_dim per key and head.
    let (heads, kv_heads, hd, tokens) = (32, 4, 128, 4096);
    let mut g = GraphBuilder::new();
    let q = g.act_input("q", tokens, heads * hd);
    let (pages, mut fixed) = one_sequence(&mut g, tokens);
    let kc = g.cache("k_cache", DType::BF16, kv_heads, tokens, hd);
    let vc = g.cache("v_cache", DType::BF16, kv_heads, tokens, hd);
    let pos = g.positions_input("pos", tokens);
    let o = g.attention(
        "attention",
        q,
        kc,
        vc,
        pos,
        pages,
        heads,
        1.0 / (hd as f32).sqrt(),
    );
    let visible = (tokens * (tokens + 1) / 2) as f64;
    fixed.push((pos.raw(), (0..tokens as u32).collect()));
    benches.push(Bench {
        name: "attention prefill 4096 causal",
        graph: finish(g, o)?,
        fixed,
        ops: 1,
        bytes: 0.0,
        flops: Some(4.0 * (hd * heads) as f64 * visible),
        target: ">= 250 TFLOP/s",
    });

    // bf16 GEMM 4096 x 2048 x 6144: a prefill projection over the bf16 activations a norm writes
    // for it (`Backend::projection_input_dtype`).
    let (m, k, n) = (4096, 2048, 6144);
    let mut g = GraphBuilder::new();
    let x = g.normed_input("x", m, k, DType::BF16);
    let w = g.dense_weight("w", DType::BF16, n, k);
    let y = g.linear("proj", x, &w);
    benches.push(Bench {
        name: "bf16 gemm 4096x2048x6144",
        graph: finish(g, y)?,
        fixed: vec![],
        ops: 1,
        bytes: 0.0,
        flops: Some(2.0 * (m * n * k) as f64),
        target: ">= 600 TFLOP/s",
    });

    // Gated delta rule over a 4,096-token prompt at Qwen3-Next's shape: 16 key heads, 32 value
    // heads, 128 x 128 state per head; chunked and as the recurrence (what `Auto` runs). FLOPs:
    // three state-sized products per token and head (the recurrence's count, for both).
    let (k_heads, v_heads, dk, dv, tokens) = (16, 32, 128, 128, 4096);
    for (name, algo) in [
        (
            "delta rule prefill 4096 chunked",
            DeltaAlgo::Chunked { chunk: 64 },
        ),
        ("delta rule prefill 4096 recurrent", DeltaAlgo::Recurrent),
    ] {
        let mut g = GraphBuilder::new();
        let q = g.act_input("q", tokens, k_heads * dk);
        let k = g.act_input("k", tokens, k_heads * dk);
        let v = g.act_input("v", tokens, v_heads * dv);
        let decay = g.act_input("g", tokens, v_heads);
        let beta = g.act_input("beta", tokens, v_heads);
        let st = g.state("state", DType::F32, [v_heads, dk, dv]);
        let o = g.delta_rule(
            "delta", q, k, v, decay, beta, st, None, k_heads, dk, v_heads, dv, algo,
        );
        benches.push(Bench {
            name,
            graph: finish(g, o)?,
            fixed: vec![],
            ops: 1,
            bytes: 0.0,
            flops: Some((tokens * v_heads * 6 * dk * dv) as f64),
            target: "none in the issue",
        });
    }

    let mut rows = Vec::new();
    for b in benches.iter().filter(|b| only.is_none_or(|s| b.name.contains(s))) {
        rows.push(measure(dev, b, reps, profile, &mut rng)?);
        // The bandwidth-bound ops of a few tens of MB, next to a plain read of their bytes.
        if b.flops.is_none() && b.ops == 1 && b.bytes < 64e6 {
            let mb = b.bytes / 1e6;
            rows.push(measure_read(
                dev,
                &format!("  plain read of {mb:.1} MB"),
                b.bytes as usize,
                reps,
            )?);
        }
    }
    // What timing costs by itself: a launch whose kernel reads next to nothing.
    if !rows.is_empty() {
        rows.push(measure_read(dev, "  plain read of 64 KB", 64 << 10, reps)?);
    }
    Ok(rows)
}
