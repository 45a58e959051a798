//! The streaming ops on CUDA against the CPU backend, exactly: a layer's cache of expert slots
//! fetched step after step (random routing, so steps hit, fill free slots and evict), under LRU
//! and the frequency policy, and longer chunks staged from the slots and from host memory, and a
//! whole layer staged. The slots chosen, the books (every word of the table) and the bytes in
//! the cache and the staging areas must be the CPU's, so the GPU's resolution follows
//! `kestrel_core::expert_slots`. And a one-token step resolved by the router's kernel, its
//! experts reading their misses from host memory: the resident layer's output, the same books.

use kestrel_core::expert_slots::{table_words, SlotPolicy};
use kestrel_core::ir::Graph;
use kestrel_core::rng::Rng;
use kestrel_core::{Backend, DType, GraphBuilder};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, RunMode};
use kestrel_testing::gpu::device_or_skip;

/// Odd sizes: 37 experts of 592 bytes, 7 slots, 3 experts a token.
const EXPERTS: usize = 37;
const SPAN: usize = 592;
const SLOTS: usize = 7;
const K: usize = 3;

struct Graphs {
    fetch: Graph,
    stage: Graph,
}

/// A fetch of 2 tokens' experts, and a stage of 9 tokens' followed by the whole layer's staged
/// into a second area, over one layer's books, host experts and cache (shared by label between
/// the two graphs).
fn graphs(policy: SlotPolicy) -> Graphs {
    let sizes = (EXPERTS, SLOTS, SPAN);
    let declare = |g: &mut GraphBuilder| {
        let table = g.state("table", DType::U32, [table_words(SLOTS, EXPERTS)]);
        let src = g.host_weight("host", EXPERTS * SPAN);
        let cache = g.expert_cache("cache", SLOTS * SPAN);
        (table, src, cache)
    };
    let mut g = GraphBuilder::new();
    let (table, src, cache) = declare(&mut g);
    let ids = g.expert_ids_input("ids", 2, K);
    let slots = g.expert_fetch("fetch", ids, table, src, cache, sizes, policy);
    g.mark_output(slots);
    let fetch = g.finish().unwrap();
    let mut g = GraphBuilder::new();
    let (table, src, cache) = declare(&mut g);
    let ids = g.expert_ids_input("ids", 9, K);
    let staging = g.expert_cache("staging", EXPERTS * SPAN);
    g.expert_stage("stage", ids, table, src, cache, staging, sizes);
    let all = g.expert_cache("staging.all", EXPERTS * SPAN);
    g.expert_stage_all("stage_all", table, src, cache, all, sizes);
    let stage = g.finish().unwrap();
    Graphs { fetch, stage }
}

/// Runs `steps` (fetch steps of 6 ids, stage steps of 27) on a backend and returns, after each
/// step, the slots (fetch) and the table, and at the end the cache and staging bytes.
fn run<B: Backend>(b: &mut B, gs: &Graphs, host: &[u8], steps: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let label =
        |g: &Graph, l: &str| kestrel_core::ir::Buf(g.bufs.iter().position(|d| d.label == l).unwrap() as u32);
    let mut fetch = b.prepare(&gs.fetch).unwrap();
    let mut stage = b.prepare(&gs.stage).unwrap();
    b.write_bytes(&mut fetch, label(&gs.fetch, "host"), 0, host)
        .unwrap();
    let mut seen = Vec::new();
    for ids in steps {
        let (p, g) = if ids.len() == 2 * K {
            (&mut fetch, &gs.fetch)
        } else {
            (&mut stage, &gs.stage)
        };
        b.upload(p, label(g, "ids"), ids).unwrap();
        b.run(p).unwrap();
        if ids.len() == 2 * K {
            seen.push(b.download::<u32>(p, label(g, "fetch.slots")).unwrap());
        }
        seen.push(b.download::<u32>(p, label(g, "table")).unwrap());
    }
    for (p, g, l) in [
        (&fetch, &gs.fetch, "cache"),
        (&stage, &gs.stage, "staging"),
        (&stage, &gs.stage, "staging.all"),
    ] {
        let mut bytes = vec![0u8; g.decl(label(g, l)).byte_len()];
        b.read_bytes(p, label(g, l), &mut bytes).unwrap();
        seen.push(
            bytes
                .chunks(4)
                .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
                .collect(),
        );
    }
    seen
}

#[test]
fn fetch_and_stage_on_cuda_follow_the_cpu_exactly() {
    let Some(dev) = device_or_skip("fetch_and_stage_on_cuda_follow_the_cpu_exactly") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    let host: Vec<u8> = (0..EXPERTS * SPAN).map(|_| rng.next_u64() as u8).collect();
    // Routing drawn from a few popular experts and the rest, so both policies hit and evict.
    let mut pick = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                if rng.range(0, 3) == 0 {
                    rng.range(0, EXPERTS) as u32
                } else {
                    rng.range(0, 9) as u32
                }
            })
            .collect()
    };
    let steps: Vec<Vec<u32>> = (0..60)
        .map(|i| if i % 10 == 9 { pick(9 * K) } else { pick(2 * K) })
        .collect();
    for policy in [SlotPolicy::Lru, SlotPolicy::Frequency { half_life: 5 }] {
        let gs = graphs(policy);
        let want = run(&mut CpuBackend::new(), &gs, &host, &steps);
        let got = run(
            &mut CudaBackend::new(dev.clone(), RunMode::Graph),
            &gs,
            &host,
            &steps,
        );
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                w == g,
                "seed {seed} {policy:?}: result {i} differs: {g:?} against {w:?}"
            );
        }
        let stats = kestrel_core::expert_slots::stats(&want[want.len() - 4]);
        assert!(
            stats.misses > SLOTS as u64 && stats.misses < stats.lookups && stats.staged > 0,
            "seed {seed} {policy:?}: the steps did not exercise the cache: {stats:?}"
        );
    }
}

/// A streamed layer's one-token step with its experts after the fetch, as a decode step runs
/// it: the CUDA backend resolves the slots in the router's kernel and the experts' kernels read
/// each miss from host memory, writing it into its slot as they go. Step after step, for 4-bit,
/// 8-bit and bf16 experts under both policies, the output must be bit for bit the resident
/// layer's (the same kernels reading every expert where it always lives; later steps' hits read
/// what earlier misses wrote) and the books `expert_slots::resolve`'s.
#[test]
fn experts_reading_their_misses_from_host_memory_compute_the_resident_output() {
    let Some(dev) =
        device_or_skip("experts_reading_their_misses_from_host_memory_compute_the_resident_output")
    else {
        return;
    };
    use kestrel_core::ir::{ExpertFormat, ExpertLayout, LinearWeight};
    use kestrel_core::quant::QuantFormat;
    let (mut rng, seed) = Rng::from_time();
    let hidden = 256;
    // Formats of gate and up, and the policy; down's format follows below.
    for (format, policy) in [
        (ExpertFormat::Quant(QuantFormat::Q4), SlotPolicy::Lru),
        (
            ExpertFormat::Quant(QuantFormat::Q8),
            SlotPolicy::Frequency { half_life: 5 },
        ),
        (ExpertFormat::Bf16, SlotPolicy::Lru),
        // GGUF's formats, with f32 group scales and biases: 4-bit gate and up beside an 8-bit
        // down (Q4_K and Q6_K), and 8-bit throughout.
        (
            ExpertFormat::Quant(QuantFormat::f32_scales(4, 32)),
            SlotPolicy::Lru,
        ),
        (
            ExpertFormat::Quant(QuantFormat::f32_scales(8, 16)),
            SlotPolicy::Frequency { half_life: 5 },
        ),
        // 8-bit gate and up beside a 4-bit down (the gate/up kernel writes its activations in
        // 4-bit order).
        (
            ExpertFormat::Quant(QuantFormat::f32_scales(8, 16)),
            SlotPolicy::Lru,
        ),
        // A k-quant's experts as GGUF files load them, scales factored: Q4_K beside Q6_K.
        (
            ExpertFormat::Quant(QuantFormat::factored(4, 32)),
            SlotPolicy::Frequency { half_life: 5 },
        ),
    ] {
        let factored = format == ExpertFormat::Quant(QuantFormat::factored(4, 32));
        // Factored scales take rows of whole 256-value super-blocks.
        let inter = if factored { 256 } else { 192 };
        let down = match (format, policy) {
            _ if factored => ExpertFormat::Quant(QuantFormat::factored(8, 16)),
            (ExpertFormat::Quant(q), _) if q == QuantFormat::f32_scales(4, 32) => {
                ExpertFormat::Quant(QuantFormat::f32_scales(8, 16))
            }
            (ExpertFormat::Quant(q), SlotPolicy::Lru) if q == QuantFormat::f32_scales(8, 16) => {
                ExpertFormat::Quant(QuantFormat::f32_scales(4, 32))
            }
            _ => format,
        };
        let layout = ExpertLayout {
            down,
            ..ExpertLayout::uniform(EXPERTS, hidden, inter, format)
        };
        let span = layout.span_bytes();
        let mut c = kestrel_testing::cases::CaseBuilder::new(Rng::new(rng.next_u64()));
        let (blob, _) = kestrel_testing::cases::random_experts(&mut c, &layout);
        let router: Vec<half::bf16> = (0..EXPERTS * hidden)
            .map(|_| half::bf16::from_f32(rng.symmetric()))
            .collect();
        // The same layer streamed and resident.
        let layer = |streamed: bool| {
            let mut g = GraphBuilder::new();
            let x = g.act_input("x", 1, hidden);
            let w = g.weight("gate.weight", DType::BF16, [EXPERTS, hidden]);
            let logits = g.linear("gate", x, &LinearWeight::Dense(w));
            let (ids, weights) = g.router("topk", logits, K, true);
            let (experts, slots, table) = if streamed {
                let table = g.state("table", DType::U32, [table_words(SLOTS, EXPERTS)]);
                let src = g.host_weight("host", EXPERTS * span);
                let cache = g.expert_cache("cache", SLOTS * span);
                let slots = g.expert_fetch("fetch", ids, table, src, cache, (EXPERTS, SLOTS, span), policy);
                (cache, slots, Some((table, src)))
            } else {
                (g.weight("experts", DType::U8, [layout.total_bytes()]), ids, None)
            };
            let cached = ExpertLayout {
                experts: if streamed { SLOTS } else { EXPERTS },
                ..layout
            };
            let out = g.moe_experts("experts", x, slots, weights, experts, cached);
            g.mark_output(ids);
            g.mark_output(out);
            g.mark_output(slots);
            (g.finish().unwrap(), x, w, ids, slots, out, experts, table)
        };
        let (rg, rx, rw, rids, _, rout, rexp, _) = layer(false);
        let (sg, sx, sw, sids, sslots, sout, _, st) = layer(true);
        let (table, src) = st.unwrap();
        let mut cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
        let mut resident = cuda.prepare(&rg).unwrap();
        let mut streamed = cuda.prepare(&sg).unwrap();
        let labels: Vec<&str> = streamed.commands().commands().iter().map(|c| c.label()).collect();
        assert!(
            labels.iter().any(|l| l.ends_with("_streamed"))
                && !labels.iter().any(|l| l.contains("expert_fetch")),
            "{format:?}: the experts do not read the misses themselves: {labels:?}"
        );
        cuda.poison(&streamed).unwrap();
        cuda.write_bytes(&mut resident, rexp.raw(), 0, &blob).unwrap();
        cuda.write_bytes(&mut streamed, src.raw(), 0, &blob).unwrap();
        let table_bytes = vec![0u8; 4 * table_words(SLOTS, EXPERTS)];
        cuda.write_bytes(&mut streamed, table.raw(), 0, &table_bytes)
            .unwrap();
        for (p, w) in [(&mut resident, rw), (&mut streamed, sw)] {
            cuda.write_bytes(p, w.raw(), 0, bytemuck::cast_slice(&router))
                .unwrap();
        }
        let mut books = vec![0u32; table_words(SLOTS, EXPERTS)];
        let mut misses = 0;
        for step in 0..40 {
            let xv: Vec<f32> = (0..hidden).map(|_| rng.symmetric()).collect();
            cuda.upload(&mut resident, rx, &xv).unwrap();
            cuda.upload(&mut streamed, sx, &xv).unwrap();
            cuda.run(&mut resident).unwrap();
            cuda.run(&mut streamed).unwrap();
            let chosen = cuda.download::<u32>(&streamed, sids).unwrap();
            assert_eq!(chosen, cuda.download::<u32>(&resident, rids).unwrap());
            let mut want = vec![0u32; K];
            let fills =
                kestrel_core::expert_slots::resolve(&mut books, SLOTS, EXPERTS, policy, &chosen, &mut want)
                    .unwrap();
            misses += fills.len();
            assert_eq!(
                cuda.download::<u32>(&streamed, sslots).unwrap(),
                want,
                "seed {seed} {format:?} step {step}"
            );
            assert_eq!(
                cuda.download::<u32>(&streamed, table).unwrap(),
                books,
                "seed {seed} {format:?} step {step}"
            );
            let (got, exp) = (
                cuda.download::<f32>(&streamed, sout).unwrap(),
                cuda.download::<f32>(&resident, rout).unwrap(),
            );
            assert!(
                got.iter().map(|v| v.to_bits()).eq(exp.iter().map(|v| v.to_bits())),
                "seed {seed} {format:?} step {step} (experts {chosen:?}): streamed output differs from resident"
            );
        }
        assert!(
            misses > SLOTS && misses < 40 * K,
            "seed {seed} {format:?}: {misses} misses"
        );
    }
}
