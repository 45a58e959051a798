//! Every op on CUDA against the CPU backend, on the shared random cases (fresh shapes and data
//! each run), with outputs poisoned before each run; eagerly and as a CUDA graph.
//!
//! Bound: every f32 output within 1e-4 of the CPU's, relative to the largest CPU value (both
//! accumulate in f32, in different orders; weights and caches hold the same bf16/f16 bits on
//! both), except quantised products, which CUDA computes on activations rounded to int8 (one
//! token) or to bf16 (several tokens) (relative L2 error 2e-2); selected ids equal.

use kestrel_core::ir::{BufKind, Op};
use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_core::{Backend, DType, GraphBuilder};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, RunMode};
use kestrel_testing::cases::{
    all_cases, as_f64, bf16_err, f32s, rel_err, rel_l2, rel_l2_over, shuffled_pages, u32s, Case, Expect,
    BF16_STEP,
};
use kestrel_testing::gpu::{device_or_skip, reopened, tensor_engines, with_fusions, without_fusions};

const TOL: f64 = 1e-4;
/// Products on rounded activations (int8 per block of 32 for quantised one-token products,
/// bf16 for tensor-core products), as relative L2 error ‖gpu - cpu‖ / ‖cpu‖: about 5e-3 for one
/// int8 product, 1e-2 for the experts, whose activations are rounded twice, 3e-3 for bf16.
const TOL_INT8_L2: f64 = 2e-2;

fn run_cuda(cuda: &mut CudaBackend, case: &Case) -> Vec<Vec<u8>> {
    let mut p = cuda
        .prepare(&case.graph)
        .unwrap_or_else(|e| panic!("{}: prepare: {e}", case.name));
    cuda.poison(&p).unwrap();
    for (buf, bytes) in &case.data {
        cuda.write_bytes(&mut p, *buf, 0, bytes).unwrap();
    }
    cuda.run(&mut p)
        .unwrap_or_else(|e| panic!("{}: run: {e}", case.name));
    case.checks
        .iter()
        .map(|c| {
            let mut out = vec![0u8; case.graph.decl(c.buf).byte_len()];
            cuda.read_bytes(&p, c.buf, &mut out)
                .unwrap_or_else(|e| panic!("{}: read: {e}", case.name));
            out
        })
        .collect()
}

/// The labels of the commands `case`'s program records on `dev` (node label, then kernel name),
/// for tests that assert which kernels a case takes.
fn command_labels(dev: &kestrel_cuda::Device, case: &Case) -> Vec<String> {
    let mut cuda = CudaBackend::new(dev.clone(), RunMode::Eager);
    let p = cuda.prepare(&case.graph).unwrap();
    p.commands()
        .commands()
        .iter()
        .map(|c| c.label().to_string())
        .collect()
}

/// Runs `case` on the CPU and on CUDA (eagerly and as a graph) and compares every check.
fn compare(dev: &kestrel_cuda::Device, case: &Case, seed: u64, round: usize) {
    let cpu_out = kestrel_testing::cases::run_case(&mut CpuBackend::new(), case).unwrap();
    for mode in [RunMode::Eager, RunMode::Graph] {
        let mut cuda = CudaBackend::new(dev.clone(), mode);
        let gpu_out = run_cuda(&mut cuda, case);
        assert_matches(
            case,
            &cpu_out,
            &gpu_out,
            &format!("seed {seed} round {round} {mode:?}"),
        );
    }
}

/// Every check of `case`: CUDA's bytes `gpu_out` against the CPU's `cpu_out`, within the bound
/// the check's kind takes; `context` opens any failure's message.
fn assert_matches(case: &Case, cpu_out: &[Vec<u8>], gpu_out: &[Vec<u8>], context: &str) {
    for ((check, c), g) in case.checks.iter().zip(cpu_out).zip(gpu_out) {
        let what = format!("{context} {} / {}", case.name, check.label);
        match check.expect {
            Expect::Floats(_) | Expect::Backends => {
                let want: Vec<f64> = f32s(c).iter().map(|&v| v as f64).collect();
                let (err, tol) = if case.rounded_activations {
                    (rel_l2_over(&f32s(g), &want, check.term_rms), TOL_INT8_L2)
                } else {
                    (rel_err(&f32s(g), &want), TOL)
                };
                assert!(err <= tol, "{what}: relative error {err:e}");
            }
            Expect::Bf16(_) => {
                let err = bf16_err(&as_f64(g, DType::BF16), &as_f64(c, DType::BF16));
                assert!(err <= BF16_STEP, "{what}: bf16 error {err:e}");
            }
            Expect::Ids(_) => assert_eq!(u32s(g), u32s(c), "{what}"),
        }
    }
}

#[test]
fn every_op_matches_the_cpu_backend() {
    let Some(dev) = device_or_skip("every_op_matches_the_cpu_backend") else {
        return;
    };
    // On Hopper, every other round with the GEMM tiles on mma.sync instead of wgmma.
    let engines = tensor_engines(&dev);
    let (mut rng, seed) = Rng::from_time();
    for round in 0..6 {
        for case in all_cases(&mut rng) {
            compare(&engines[round % engines.len()], &case, seed, round);
        }
    }
}

/// Several prompts' chunks beside a batched step's own tokens: runs of 16 or 8 tokens each of
/// its own sequence, on flash blocks that each take one run's sequence (or, where a block's
/// rows would cross a run or the cache is f32, each token on its own).
#[test]
fn attention_in_runs_matches_the_cpu_backend() {
    let Some(dev) = device_or_skip("attention_in_runs_matches_the_cpu_backend") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    for round in 0..24 {
        let case = kestrel_testing::cases::attention_runs(Rng::new(rng.next_u64()));
        println!("{}", case.name);
        compare(&dev, &case, seed, round);
    }
}

/// One token's inputs of attention (norms, rotation, the cache append; gated or not, partial
/// rotation) and the attention that reads them, which Hopper runs as one kernel
/// (`decode_attention_inputs_*`), on half caches of up to hundreds of positions (one split or
/// several), of one sequence or of a batched step's pool. A third of the rounds take splits of
/// at least 1,000 keys (`Config::decode_split_keys`), where the new key often lies past a warp's
/// first batches (written to the cache, not the ring), and a third run with the fusions off
/// (the two kernels apart, as before Hopper).
#[test]
fn one_token_inputs_and_attention_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("one_token_inputs_and_attention_match_the_cpu_backend") else {
        return;
    };
    let fused = with_fusions(&dev);
    let apart = without_fusions(&dev);
    let deep = kestrel_testing::gpu::reopened(&dev, "the fusions on and deep splits", |c| {
        c.fused_attention = true;
        c.fused_norm = true;
        c.decode_split_keys = 1000;
    });
    let hopper = dev.info().compute_capability.0 >= 9;
    let (mut rng, seed) = Rng::from_time();
    for round in 0..24 {
        let (dev, how) = match round % 3 {
            0 => (&fused, ""),
            1 => (&deep, ", deep splits"),
            _ => (&apart, ", fusions off"),
        };
        let case = kestrel_testing::cases::attention_inputs_decode(Rng::new(rng.next_u64()));
        println!("{}{how}", case.name);
        compare(dev, &case, seed, round);
        let labels = command_labels(dev, &case);
        let ran_fused = labels.iter().any(|l| l.contains("decode_attention_inputs_"));
        assert!(
            ran_fused == (hopper && dev.fused_attention()),
            "seed {seed} round {round} {}{how}: {labels:?}",
            case.name
        );
    }
}

/// The inputs of attention for 128 tokens or more (norms, rotation, the cache append; gated or
/// not, full or partial rotation, one sequence or a batched step's pool): four heads of a token a
/// warp (`attention_inputs_rows_*`) where the head dim is 64, 128 or 256 and the rotated half a
/// power-of-two multiple of 32 (or nothing rotated), else a head a warp; about half the draws
/// take each.
#[test]
fn many_tokens_attention_inputs_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("many_tokens_attention_inputs_match_the_cpu_backend") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    let mut by_rows = 0;
    for round in 0..24 {
        let case = kestrel_testing::cases::attention_inputs_many(Rng::new(rng.next_u64()));
        println!("{}", case.name);
        compare(&dev, &case, seed, round);
        let labels = command_labels(&dev, &case);
        let rows = labels.iter().any(|l| l.contains("attention_inputs_rows_"));
        let warps = labels.iter().any(|l| l.contains("attention_inputs_warps_"));
        assert!(
            rows != warps,
            "seed {seed} round {round} {}: {labels:?}",
            case.name
        );
        by_rows += usize::from(rows);
    }
    assert!(
        by_rows > 0 && by_rows < 24,
        "seed {seed}: {by_rows} of 24 rounds four heads a warp"
    );
}

/// One token's norm (with a residual add or without) and the quantised projection reading it,
/// which CUDA runs as one kernel: the product, the normed row and the new residual match the
/// CPU, and the program holds the fused kernel and no norm kernel of its own; odd rounds run with
/// the fusions off, and cases whose normed row has a second product keep the norm apart too.
#[test]
fn one_token_norm_and_projection_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("one_token_norm_and_projection_match_the_cpu_backend") else {
        return;
    };
    let (fused, apart) = (with_fusions(&dev), without_fusions(&dev));
    let (mut rng, seed) = Rng::from_time();
    for round in 0..24 {
        let dev = if round % 2 == 0 { &fused } else { &apart };
        let case = kestrel_testing::cases::norm_then_linear_decode(Rng::new(rng.next_u64()));
        println!(
            "{}{}",
            case.name,
            if round % 2 == 0 { "" } else { ", fusions off" }
        );
        compare(dev, &case, seed, round);
        let labels = command_labels(dev, &case);
        let ran_fused = labels.iter().any(|l| l.contains("matvec_norm_"));
        let norm_apart = labels.iter().any(|l| l.contains("rms_norm"));
        let products = case
            .graph
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Linear { .. }))
            .count();
        let one_reader = products == 1;
        assert!(
            ran_fused == (dev.fused_norm() && one_reader) && norm_apart != ran_fused,
            "seed {seed} round {round} {}: {labels:?}",
            case.name
        );
    }
}

/// A few tokens' residual add and norm in front of a router's product and choice against the CPU
/// backend; on Hopper, up to 8 tokens run the three as one kernel, a cluster a token
/// (`route_norm_*`), and 9 take the kernels apart.
#[test]
fn few_tokens_norm_and_router_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("few_tokens_norm_and_router_match_the_cpu_backend") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    for round in 0..16 {
        let case = kestrel_testing::cases::norm_then_router(Rng::new(rng.next_u64()));
        println!("{}", case.name);
        compare(&dev, &case, seed, round);
        let labels = command_labels(&dev, &case);
        let tokens = case.graph.nodes.iter().find_map(|n| match n.op {
            Op::Router { tokens, .. } => Some(tokens),
            _ => None,
        });
        let fused = labels.iter().any(|l| l.contains("route_norm_"));
        let expected = dev.info().compute_capability.0 >= 9 && tokens.is_some_and(|t| t <= 8);
        assert!(
            fused == expected,
            "seed {seed} round {round} {}: {labels:?}",
            case.name
        );
    }
}

/// A batched step's few tokens through a norm and the quantised products reading it against the
/// CPU backend; the norm stores its rows rounded to bf16 (no conversion before the products)
/// exactly when every reader is a skinny product (outputs in whole 16s) and the rows are not an
/// output of the program, and else the first product (always a skinny one) converts them.
#[test]
fn few_tokens_norm_and_products_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("few_tokens_norm_and_products_match_the_cpu_backend") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    for round in 0..16 {
        let case = kestrel_testing::cases::norm_then_linears_few_tokens(Rng::new(rng.next_u64()));
        println!("{}", case.name);
        compare(&dev, &case, seed, round);
        let labels = command_labels(&dev, &case);
        let normed = case.graph.nodes.iter().find_map(|n| match n.op {
            Op::RmsNorm { out, .. } | Op::AddRmsNorm { out, .. } => Some(out),
            _ => None,
        });
        let normed = normed.expect("the case has a norm");
        let skinny_readers = case.graph.nodes.iter().all(|n| match n.op {
            Op::Linear { out_dim, .. } => out_dim % 16 == 0,
            _ => true,
        });
        let expected = skinny_readers && case.graph.decl(normed).kind == BufKind::Transient;
        let rounded = labels
            .iter()
            .any(|l| l.contains("rms_norm") && l.ends_with("_to_bf16"));
        let converted = labels.iter().any(|l| l.contains("convert_f32_bf16"));
        assert!(
            rounded == expected && converted != expected,
            "seed {seed} round {round} {}: {labels:?}",
            case.name
        );
    }
}

/// Attention read by a quantised product (a layer's o_proj) against the CPU backend, over the
/// random attention shapes: one sequence's tokens, a token of each of several, mixed steps. Where
/// the decode kernel takes the whole op and only a skinny product reads its output (2 to 128
/// tokens, outputs in whole 16s, the output not checked itself), it stores the output rounded to
/// bf16 and no conversion runs; elsewhere a skinny product converts it.
#[test]
fn attention_then_product_matches_the_cpu_backend() {
    let Some(dev) = device_or_skip("attention_then_product_matches_the_cpu_backend") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    let (mut rounded_rounds, mut rounded_mixed, mut rounded_flash) = (0, 0, 0);
    for round in 0..48 {
        let case = kestrel_testing::cases::attention_then_product(Rng::new(rng.next_u64()));
        println!("{}", case.name);
        compare(&dev, &case, seed, round);
        let labels = command_labels(&dev, &case);
        let Some((out, tokens, chunk)) = case.graph.nodes.iter().find_map(|n| match n.op {
            Op::Attention {
                out, tokens, chunk, ..
            } => Some((out, tokens, chunk)),
            _ => None,
        }) else {
            panic!("{}: no attention", case.name);
        };
        let Some(out_dim) = case.graph.nodes.iter().find_map(|n| match n.op {
            Op::Linear { out_dim, .. } => Some(out_dim),
            _ => None,
        }) else {
            continue;
        };
        let skinny = (2..=128).contains(&tokens) && out_dim % 16 == 0;
        // Every attention kernel that ran can round its output: the decode, flash and split
        // kernels and the merge of splits can, the plain kernel cannot (a mixed step's tokens and
        // its chunk may take different ones).
        let attention: Vec<&String> = labels.iter().filter(|l| l.starts_with("attn/")).collect();
        let can_round = |l: &str| {
            [
                "decode_attention_",
                "flash_attention_",
                "attention_split_",
                "attention_combine",
            ]
            .iter()
            .any(|k| l.contains(k))
        };
        let rounding = !attention.is_empty() && attention.iter().all(|l| can_round(l));
        let expected = skinny && rounding && case.graph.decl(out).kind == BufKind::Transient;
        let mixed = chunk.is_some_and(|c| c.from > 0 && c.from < tokens);
        rounded_mixed += usize::from(expected && mixed);
        rounded_flash += usize::from(expected && attention.iter().any(|l| l.contains("flash_attention_")));
        rounded_rounds += usize::from(expected);
        // A skinny product converts the output exactly when it was not stored rounded (other
        // products may convert or not, as their kernels need).
        let converted = labels.iter().any(|l| l.contains("convert_f32_bf16"));
        assert!(
            !skinny || converted != expected,
            "seed {seed} round {round} {}: {labels:?}",
            case.name
        );
    }
    println!(
        "{rounded_rounds} of 48 rounds stored the output rounded ({rounded_flash} through the flash \
         kernel, {rounded_mixed} in a mixed step)"
    );
    if dev.info().compute_capability.0 >= 9 {
        assert!(
            rounded_rounds > 0,
            "seed {seed}: no round stored the output rounded"
        );
    }
}

/// One token of a MoE layer at Qwen3-30B-A3B's expert shapes (the random cases' layers are
/// small): the router's 8-bit product and choice as one cluster kernel, then gate/up and down
/// over rows of 2,048 and 768 values, as a decode step runs them; in a third of the rounds the
/// same with a GGUF Q4_K_M file's experts (factored scales, Q6_K down) behind a dense router; and
/// in another third experts as wide as Qwen3.5-397B-A17B's at top-10, whose rows of `down` take
/// more than one round of loads.
#[test]
fn moe_decode_at_model_shape_matches_the_cpu_backend() {
    let Some(dev) = device_or_skip("moe_decode_at_model_shape_matches_the_cpu_backend") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    for round in 0..6 {
        let case_rng = Rng::new(rng.next_u64());
        let case = match round % 3 {
            0 => kestrel_testing::cases::moe_decode_model_shape(case_rng),
            1 => kestrel_testing::cases::moe_decode_gguf_shape(case_rng),
            _ => kestrel_testing::cases::moe_decode_wide_shape(case_rng),
        };
        compare(&dev, &case, seed, round);
    }
}

/// Quantised projections of a few tokens, which CUDA runs as skinny tensor-core products (2 to
/// 128 tokens), at shapes that take every count of row tiles a warp holds and both ways of
/// splitting K over warps: narrow and wide projections (17,600 outputs fill the GPU without a
/// split) and groups of 32 to 128.
#[test]
fn skinny_projections_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("skinny_projections_match_the_cpu_backend") else {
        return;
    };
    let dev = reopened(&dev, "no dequantised projections", |c| {
        c.dequant_projections_from = 0
    });
    let (mut rng, seed) = Rng::from_time();
    let shapes: Vec<_> = [2, 7, 13, 29, 64, 101]
        .into_iter()
        .map(|tokens| {
            let in_dim = 128 * rng.range(1, 4);
            let wide = rng.range(0, 2) == 0;
            (tokens, in_dim, if wide { 17600 } else { 16 * rng.range(1, 40) })
        })
        .collect();
    linear_products(&dev, &mut rng, seed, &shapes);
}

/// Quantised projections of 33 to 128 tokens, which Hopper runs on wgmma (`linear_wide_*`: tiles
/// of 64 tokens, 32 where a tile's rows fit them, on x copied into their layout), with wgmma on
/// and with it off (the skinny products): deep, narrow products whose few tiles split K over 2
/// to 8 blocks (the partial tiles added by the last block of each tile), and shallow, wide ones
/// that do not split; every quantised format.
#[test]
fn wide_projections_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("wide_projections_match_the_cpu_backend") else {
        return;
    };
    let never = |c: &mut kestrel_core::Config| c.dequant_projections_from = 0;
    let mut engines = vec![reopened(&dev, "no dequantised projections", never)];
    if dev.wgmma() {
        engines.push(reopened(&dev, "no dequantised projections, wgmma off", |c| {
            never(c);
            c.wgmma = false;
        }));
    }
    let (mut rng, seed) = Rng::from_time();
    for (round, tokens) in [33, 47, 64, 100, 128].into_iter().enumerate() {
        let deep = (1024 * rng.range(1, 5), 64 * rng.range(1, 40));
        let wide = (128 * rng.range(1, 8), 64 * rng.range(100, 300));
        for (in_dim, out_dim) in [deep, wide] {
            for format in kestrel_testing::cases::QUANT_FORMATS {
                let case_rng = Rng::new(rng.next_u64());
                let case = kestrel_testing::cases::linear_shape(case_rng, tokens, (in_dim, out_dim), format);
                for engine in &engines {
                    compare(engine, &case, seed, round);
                }
            }
        }
    }
}

/// Routed experts of a few rows each, which CUDA runs as skinny tensor-core products: a half to
/// 42.5 rows an expert behind the router's exact 8-bit product of as many tokens (30 rows each
/// from given router logits: `moe_batch_shape` says why), gate and up beside a down of the same
/// bits and of the other (gate/up then writes the activations in down's layout). On Hopper,
/// experts of 7.5 to 42.5 rows each take the wgmma form of these products (tiles of 16, 32 and
/// 64 rows) with wgmma on, the mma.sync forms and GEMM tiles without it: the cases alternate
/// between the two. The products are taken from 2 tokens on (`Config::skinny_experts_from`);
/// below the default's count, each case also runs as a model does, on one token's kernels.
#[test]
fn skinny_experts_at_2_and_12_tokens_match_the_cpu_backend() {
    skinny_experts(
        "skinny_experts_at_2_and_12_tokens_match_the_cpu_backend",
        &[2, 12],
        0,
    );
}

/// As above, at 30 and 80 tokens (a test of its own so that test threads share the cases).
#[test]
fn skinny_experts_at_30_and_80_tokens_match_the_cpu_backend() {
    skinny_experts(
        "skinny_experts_at_30_and_80_tokens_match_the_cpu_backend",
        &[30, 80],
        2,
    );
}

/// As above, at 120 and 170 tokens.
#[test]
fn skinny_experts_at_120_and_170_tokens_match_the_cpu_backend() {
    skinny_experts(
        "skinny_experts_at_120_and_170_tokens_match_the_cpu_backend",
        &[120, 170],
        4,
    );
}

/// The skinny experts' cases at each of `token_counts`, rounds numbered from `first_round` (the
/// engine of a case alternates with its round).
fn skinny_experts(test: &str, token_counts: &[usize], first_round: usize) {
    let Some(dev) = device_or_skip(test) else {
        return;
    };
    let skinny_from_2 = |c: &mut kestrel_core::Config| c.skinny_experts_from = 2;
    let mut engines = vec![reopened(&dev, "skinny experts from 2 tokens", skinny_from_2)];
    if dev.wgmma() {
        engines.push(reopened(&dev, "skinny experts from 2 tokens, wgmma off", |c| {
            skinny_from_2(c);
            c.wgmma = false;
        }));
    }
    let (mut rng, seed) = Rng::from_time();
    let formats = kestrel_testing::cases::QUANT_FORMATS;
    use kestrel_testing::cases::FACTORED_FORMATS;
    for (round, &tokens) in (first_round..).zip(token_counts) {
        // MLX's defaults, GGUF's two, 4-bit gate and up beside an 8-bit down (GGUF's Q4_K
        // beside Q6_K, and MLX's), 8-bit gate and up beside a 4-bit down, and factored scales.
        let pairs = [
            (formats[0], formats[1]),
            (formats[0], formats[0]),
            (formats[1], formats[1]),
            (formats[4], formats[4]),
            (formats[5], formats[5]),
            (formats[4], formats[5]),
            (formats[1], formats[0]),
            (formats[5], formats[4]),
            // A GGUF k-quant's experts, scales factored: Q4_K beside Q6_K, and Q4_K alone.
            (FACTORED_FORMATS[0], FACTORED_FORMATS[1]),
            (FACTORED_FORMATS[0], FACTORED_FORMATS[0]),
        ];
        for (i, (format, down)) in pairs.into_iter().enumerate() {
            let case =
                kestrel_testing::cases::moe_batch_shape(Rng::new(rng.next_u64()), tokens, format, down);
            compare(&engines[(round + i) % engines.len()], &case, seed, round);
            if tokens < dev.skinny_experts_from() {
                compare(&dev, &case, seed, round);
            }
            println!("{tokens} tokens, gate/up {format:?}, down {down:?}: as the CPU's");
        }
    }
}

/// Quantised products of more tokens than the skinny ones take, as tensor-core tiles, at shapes
/// whose tiles are too few to fill the GPU, so K is split over blocks and the partial tiles added
/// (ranges that start inside a group of 128 too): 150 to 333 tokens, every quantised format. The
/// weights' dequantisation for cuBLAS is switched off, so every product takes the tiles.
#[test]
fn tensor_core_products_with_k_split_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("tensor_core_products_with_k_split_match_the_cpu_backend") else {
        return;
    };
    let dev = reopened(&dev, "no dequantised projections", |c| {
        c.dequant_projections_from = 0
    });
    let (mut rng, seed) = Rng::from_time();
    let shapes = [
        (150, 640, 128),
        (150, 4096, 2048),
        (333, 2048, 5120),
        (200, 1024, 320),
    ];
    linear_products(&dev, &mut rng, seed, &shapes);
    for (tokens, in_dim, out_dim) in shapes {
        let case =
            kestrel_testing::cases::linear_shape(Rng::new(seed), tokens, (in_dim, out_dim), QuantFormat::Q4);
        let labels = command_labels(&dev, &case);
        assert!(labels.iter().any(|l| l.contains("linear_gemm_")), "{labels:?}");
    }
}

/// Quantised products whose weights are dequantised to bf16 first and multiplied by cuBLAS
/// (`Config::dequant_projections_from`, here from 2 tokens): 2 to 728 tokens, shapes that are not
/// whole tiles of cuBLAS's or of the GEMM tiles, every quantised format, with the backend's bf16
/// copies of the weights and without them. With copies the program records cuBLAS's product
/// only (the dequantisation fills the copy outside it); without, the dequantisation and the
/// product; with the switch at 0, neither.
#[test]
fn dequantised_projections_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("dequantised_projections_match_the_cpu_backend") else {
        return;
    };
    let from_2 = |c: &mut kestrel_core::Config| c.dequant_projections_from = 2;
    let copies = reopened(&dev, "dequantised projections from 2 tokens", from_2);
    let no_copies = reopened(&dev, "dequantised projections from 2 tokens, no copies", |c| {
        from_2(c);
        c.projection_copies = false;
    });
    let never = reopened(&dev, "no dequantised projections", |c| {
        c.dequant_projections_from = 0
    });
    let (mut rng, seed) = Rng::from_time();
    let shapes = [
        (2, 640, 40),
        (37, 2048, 5120),
        (129, 640, 136),
        (150, 4096, 2048),
        (517, 1024, 320),
        (
            2 + rng.range(0, 700),
            128 * rng.range(1, 20),
            8 * rng.range(1, 800),
        ),
    ];
    linear_products(&copies, &mut rng, seed, &shapes);
    linear_products(&no_copies, &mut rng, seed, &shapes[3..]);
    for (tokens, in_dim, out_dim) in shapes {
        for format in kestrel_testing::cases::QUANT_FORMATS {
            let case =
                kestrel_testing::cases::linear_shape(Rng::new(seed), tokens, (in_dim, out_dim), format);
            let kernels = |d| {
                let labels = command_labels(d, &case);
                let has = |k: &str| labels.iter().any(|l| l.contains(k));
                (has("dequant_"), has("gemm_bf16"))
            };
            let what = format!("seed {seed} {}", case.name);
            assert_eq!(kernels(&copies), (false, true), "{what}, copies");
            assert_eq!(kernels(&no_copies), (true, true), "{what}, no copies");
            assert_eq!(kernels(&never), (false, false), "{what}, never");
        }
    }
}

/// The bf16 copies of dequantised projections follow their weights: new weights written into a
/// program that has run are what its next run multiplies by, and a second program over the same
/// weights (other tokens, the weights not written again) reads the same copy, which the backend
/// holds once.
#[test]
fn projection_copies_follow_their_weights() {
    let Some(dev) = device_or_skip("projection_copies_follow_their_weights") else {
        return;
    };
    let dev = reopened(&dev, "dequantised projections from 2 tokens", |c| {
        c.dequant_projections_from = 2
    });
    let (mut rng, seed) = Rng::from_time();
    let dims = (128 * rng.range(1, 20), 8 * rng.range(1, 400));
    let formats = kestrel_testing::cases::QUANT_FORMATS;
    let format = formats[rng.range(0, formats.len())];
    let case = |tokens, rng: &mut Rng| {
        kestrel_testing::cases::linear_shape(Rng::new(rng.next_u64()), tokens, dims, format)
    };
    let (first, second, mut other) = (case(40, &mut rng), case(40, &mut rng), case(77, &mut rng));
    let context = |what: &str| format!("seed {seed} ({dims:?}, {format:?}): {what}");
    let cpu = |c: &Case| kestrel_testing::cases::run_case(&mut CpuBackend::new(), c).unwrap();
    let read = |cuda: &mut CudaBackend, p: &kestrel_cuda::CudaProgram, c: &Case| -> Vec<Vec<u8>> {
        (c.checks.iter())
            .map(|check| {
                let mut out = vec![0u8; c.graph.decl(check.buf).byte_len()];
                cuda.read_bytes(p, check.buf, &mut out).unwrap();
                out
            })
            .collect()
    };
    let is_weight = |c: &Case, b| c.graph.decl(b).kind == BufKind::Weight;
    let mut cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
    let mut p = cuda.prepare(&first.graph).unwrap();
    for c in [&first, &second] {
        cuda.poison(&p).unwrap();
        for (buf, bytes) in &c.data {
            cuda.write_bytes(&mut p, *buf, 0, bytes).unwrap();
        }
        cuda.run(&mut p).unwrap();
        let gpu = read(&mut cuda, &p, c);
        assert_matches(c, &cpu(c), &gpu, &context("weights written into the program"));
    }
    let held = cuda.projection_copy_bytes();
    assert_eq!(held, dims.0 * dims.1 * 2, "{}", context("one copy"));
    // The other tokens' program over `second`'s weights, as uploaded.
    let mut q = cuda.prepare(&other.graph).unwrap();
    cuda.poison(&q).unwrap();
    for (buf, bytes) in other.data.iter().filter(|(b, _)| !is_weight(&other, *b)) {
        cuda.write_bytes(&mut q, *buf, 0, bytes).unwrap();
    }
    cuda.run(&mut q).unwrap();
    let gpu = read(&mut cuda, &q, &other);
    // The CPU's reference: the same tokens over `second`'s weights.
    for (buf, bytes) in &mut other.data {
        let d = other.graph.decl(*buf);
        if d.kind == BufKind::Weight {
            let from = second
                .data
                .iter()
                .find(|(b, _)| second.graph.decl(*b).label == d.label);
            *bytes = from.expect("the same weights' labels").1.clone();
        }
    }
    assert_matches(&other, &cpu(&other), &gpu, &context("a second program"));
    assert_eq!(
        cuda.projection_copy_bytes(),
        held,
        "{}",
        context("still one copy")
    );
}

/// Quantised products of (tokens, in, out) in every quantised format, against the CPU backend.
fn linear_products(dev: &kestrel_cuda::Device, rng: &mut Rng, seed: u64, shapes: &[(usize, usize, usize)]) {
    for (round, &(tokens, in_dim, out_dim)) in shapes.iter().enumerate() {
        for format in kestrel_testing::cases::QUANT_FORMATS {
            let case_rng = Rng::new(rng.next_u64());
            let case = kestrel_testing::cases::linear_shape(case_rng, tokens, (in_dim, out_dim), format);
            compare(dev, &case, seed, round);
        }
    }
}

/// Router logits of many tokens (the exact product, several tokens a block) against the CPU
/// backend, and each token's row bit for bit what the same token gets alone (the one-token exact
/// product), so a sequence's routing does not depend on what it is batched with: 2 to 700
/// tokens, 4- and 8-bit weights and dense ones (bf16 as a bf16 checkpoint's, f32 as a GGUF file's:
/// one token on `matvec_bf16` / `matvec_f32_exact`, more on their `_exact_tokens`). With 128 experts on 132 multiprocessors, 9 and 64 tokens take
/// blocks of 2 tokens, 256 of 4, 301 and 700 of 8.
#[test]
fn router_logits_of_many_tokens_equal_one_token_at_a_time() {
    let Some(dev) = device_or_skip("router_logits_of_many_tokens_equal_one_token_at_a_time") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    for (round, tokens) in [2, 9, 64, 256, 301, 700].into_iter().enumerate() {
        for (format, dense) in [
            (Some(QuantFormat::Q8), DType::BF16),
            (Some(QuantFormat::Q4), DType::BF16),
            (None, DType::BF16),
            (None, DType::F32),
        ] {
            let s = rng.next_u64();
            let many = kestrel_testing::cases::router_shape(Rng::new(s), tokens, format, dense);
            compare(&dev, &many, seed, round);
            let mut one = kestrel_testing::cases::router_shape(Rng::new(s), 1, format, dense);
            let label = |c: &Case, b| c.graph.decl(b).label.clone();
            let x = |c: &Case| c.data.iter().position(|(b, _)| label(c, *b) == "x").expect("x");
            let (xm, xo) = (x(&many), x(&one));
            let row = one.data[xo].1.len();
            let mut cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
            let all = f32s(&run_cuda(&mut cuda, &many)[0]);
            let width = all.len() / tokens;
            for t in [0, tokens / 2, tokens - 1] {
                one.data[xo].1 = many.data[xm].1[t * row..(t + 1) * row].to_vec();
                let alone = f32s(&run_cuda(&mut cuda, &one)[0]);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&alone),
                    bits(&all[t * width..(t + 1) * width]),
                    "seed {seed}: token {t} of {tokens} ({format:?}, {dense:?}) against alone"
                );
            }
        }
    }
}

/// A router's choice of many tokens with its logits bounded first (`Config::bounded_router`)
/// equals, bit for bit, the choice from every logit computed exactly: the same experts and the
/// same weights, on `cases::router_choice`'s planted ties (a near tie at the k-th place of most
/// tokens, exact ties, a token of zeros, one that overflows, one with a NaN). 4- and 8-bit
/// weights with bf16 and f32 group scales; 128 experts (Qwen3-30B-A3B's router), 512 (Qwen3-Next's),
/// 60 and 20; token counts that are not whole tiles, from 512 (fewer take the exact product).
#[test]
fn bounded_router_chooses_as_every_exact_logit_does() {
    let Some(dev) = device_or_skip("bounded_router_chooses_as_every_exact_logit_does") else {
        return;
    };
    let on = reopened(&dev, "the bounded router on", |c| c.bounded_router = true);
    let off = reopened(&dev, "the bounded router off", |c| c.bounded_router = false);
    let (mut rng, seed) = Rng::from_time();
    let [q4, q8, q4g32, q8g128, q4f, q8f] = kestrel_testing::cases::QUANT_FORMATS;
    for (round, (tokens, shape, format)) in [
        (512, (2048, 128, 7), q8),
        (533, (2048, 128, 7), q4),
        (2050, (2048, 128, 9), q8),
        (700, (1408, 60, 5), q8g128),
        (1000, (2048, 512, 11), q8),
        (529, (1024, 20, 3), q4g32),
        (600, (2048, 128, 1), q4f),
        (770, (768, 128, 7), q8f),
    ]
    .into_iter()
    .enumerate()
    {
        let case = kestrel_testing::cases::router_choice(Rng::new(rng.next_u64()), tokens, shape, format);
        println!("{}", case.name);
        let bounded = |d| {
            command_labels(d, &case)
                .iter()
                .any(|l| l.contains("router_choose_"))
        };
        assert!(
            bounded(&on) && !bounded(&off),
            "seed {seed} round {round} {}",
            case.name
        );
        let chosen =
            |d: &kestrel_cuda::Device| run_cuda(&mut CudaBackend::new(d.clone(), RunMode::Graph), &case);
        let (a, b) = (chosen(&on), chosen(&off));
        for (check, (a, b)) in ["ids", "weights"].iter().zip(a.iter().zip(&b)) {
            let differ = a.chunks(4).zip(b.chunks(4)).position(|(x, y)| x != y);
            assert!(
                differ.is_none(),
                "seed {seed} round {round} {}: {check} differ first at slot {differ:?}",
                case.name
            );
        }
    }
}

/// Long caches, against the CPU backend: a prefill long enough that tensor-core attention needs
/// no split over the cache (every block writes its rows' normalised output directly, the path
/// the shared random cases, a few dozen tokens each, never reach), and one token decoded at the
/// end of the same cache (split into more parts than a warp merges, so a block per row merges
/// them): 2,200 tokens, 16 query / 2 KV heads, head dims 128 and 256, bf16 and f16 caches.
/// Queries and probabilities are rounded to the cache's type on CUDA, so the bound is the
/// rounded-activation one.
#[test]
fn long_prefill_attention_matches_the_cpu_backend() {
    let Some(dev) = device_or_skip("long_prefill_attention_matches_the_cpu_backend") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    let (ctx, heads, kv_heads) = (2200, 16, 2);
    for (hd, dtype, tokens) in [
        (128, DType::BF16, ctx),
        (256, DType::F16, ctx),
        (128, DType::BF16, 1),
        (256, DType::F16, 1),
    ] {
        let mut g = GraphBuilder::new();
        let q = g.act_input("q", tokens, heads * hd);
        // One sequence in blocks of 16, scattered over the cache.
        let (pages, rows, page_data) = shuffled_pages(&mut g, &mut rng, 1, ctx, 16, false);
        let kc = g.cache("k_cache", dtype, kv_heads, rows, hd);
        let vc = g.cache("v_cache", dtype, kv_heads, rows, hd);
        let pos = g.positions_input("pos", tokens);
        let out = g.attention(
            "attention",
            q,
            kc,
            vc,
            pos,
            pages,
            heads,
            1.0 / (hd as f32).sqrt(),
        );
        g.mark_output(out);
        let graph = g.finish().unwrap();
        let qv: Vec<f32> = (0..tokens * heads * hd).map(|_| rng.symmetric()).collect();
        let cache = |rng: &mut Rng| -> Vec<u8> {
            let v: Vec<f32> = (0..kv_heads * rows * hd).map(|_| rng.symmetric()).collect();
            match dtype {
                DType::BF16 => {
                    bytemuck::cast_slice(&v.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<_>>())
                        .to_vec()
                }
                _ => bytemuck::cast_slice(&v.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>())
                    .to_vec(),
            }
        };
        let (kb, vb) = (cache(&mut rng), cache(&mut rng));
        // A prefill from position 0, or the last position of the cache.
        let positions: Vec<u32> = ((ctx - tokens) as u32..ctx as u32).collect();
        let mut results = Vec::new();
        let mut cpu = CpuBackend::new();
        let mut cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
        {
            let mut p = cpu.prepare(&graph).unwrap();
            for (b, d) in &page_data {
                cpu.write_bytes(&mut p, *b, 0, d).unwrap();
            }
            cpu.upload(&mut p, q, &qv).unwrap();
            cpu.write_bytes(&mut p, kc.raw(), 0, &kb).unwrap();
            cpu.write_bytes(&mut p, vc.raw(), 0, &vb).unwrap();
            cpu.upload(&mut p, pos, &positions).unwrap();
            cpu.run(&mut p).unwrap();
            results.push(cpu.download::<f32>(&p, out).unwrap());
        }
        {
            let mut p = cuda.prepare(&graph).unwrap();
            cuda.poison(&p).unwrap();
            for (b, d) in &page_data {
                cuda.write_bytes(&mut p, *b, 0, d).unwrap();
            }
            cuda.upload(&mut p, q, &qv).unwrap();
            cuda.write_bytes(&mut p, kc.raw(), 0, &kb).unwrap();
            cuda.write_bytes(&mut p, vc.raw(), 0, &vb).unwrap();
            cuda.upload(&mut p, pos, &positions).unwrap();
            cuda.run(&mut p).unwrap();
            results.push(cuda.download::<f32>(&p, out).unwrap());
        }
        let want: Vec<f64> = results[0].iter().map(|&v| v as f64).collect();
        let err = rel_l2(&results[1], &want);
        println!("attention over {ctx} cached, {tokens} tokens, d{hd} {dtype}: relative L2 error {err:e}");
        assert!(
            err <= TOL_INT8_L2,
            "seed {seed} {tokens} tokens d{hd} {dtype}: relative L2 error {err:e}"
        );
    }
}

/// Decode over a long bf16 cache at the shapes of Qwen3-30B-A3B's attention (32 query / 4 KV
/// heads, head dim 128, 8,192 positions a sequence, in blocks of 16 scattered over the cache),
/// against the CPU backend: one token, two (as a short chunk runs), and a batched step of six
/// sequences of different lengths, whose keys and values a `KvAppend` writes just before the attention, at
/// positions that leave every split of the cache in use, some of them, or only the first, and
/// at the edges of a split's first batches. One prepared program run again and again (eagerly
/// and as graph replays, where the attention launches while the append finishes and reads the
/// older rows before it waits), with fresh queries, keys and values and the output poisoned
/// each time, so reading a new row before the append wrote it, or leaving the merge counters
/// anywhere but zero, fails. Each case runs with the splits as configured and again with
/// `Config::decode_split_keys` at 1,000 (fewer blocks, several rounds of batches each).
#[test]
fn decode_attention_over_a_long_cache_matches_the_cpu_backend_run_after_run() {
    let Some(dev) =
        device_or_skip("decode_attention_over_a_long_cache_matches_the_cpu_backend_run_after_run")
    else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    let (ctx, heads, kv_heads, hd) = (8192, 32, 4, 128);
    let cache = |rng: &mut Rng, rows: usize| -> Vec<u8> {
        let v: Vec<half::bf16> = (0..kv_heads * rows * hd)
            .map(|_| half::bf16::from_f32(2.0 * rng.symmetric()))
            .collect();
        bytemuck::cast_slice(&v).to_vec()
    };
    // As configured, and with each block taking at least 1,000 keys (rounded up to whole
    // rounds of the warps' batches: fewer, deeper splits; `Config::decode_split_keys`).
    let deep = kestrel_testing::gpu::reopened(&dev, "deep decode splits", |c| c.decode_split_keys = 1000);
    for ((tokens, batched), dev) in [(1, false), (2, false), (6, true)]
        .into_iter()
        .flat_map(|case| [(case, &dev), (case, &deep)])
    {
        let splits = if std::ptr::eq(dev, &deep) {
            "deep splits"
        } else {
            "splits as configured"
        };
        let mut g = GraphBuilder::new();
        let q = g.act_input("q", tokens, heads * hd);
        let k = g.act_input("k", tokens, kv_heads * hd);
        let v = g.act_input("v", tokens, kv_heads * hd);
        let seqs = if batched { tokens } else { 1 };
        let (pages, rows, page_data) = shuffled_pages(&mut g, &mut rng, seqs, ctx, 16, batched);
        let (kb, vb) = (cache(&mut rng, rows), cache(&mut rng, rows));
        let kc = g.cache("k_cache", DType::BF16, kv_heads, rows, hd);
        let vc = g.cache("v_cache", DType::BF16, kv_heads, rows, hd);
        let pos = g.positions_input("pos", tokens);
        g.kv_append("append", k, v, pos, kc, vc, pages);
        let out = g.attention(
            "attention",
            q,
            kc,
            vc,
            pos,
            pages,
            heads,
            1.0 / (hd as f32).sqrt(),
        );
        g.mark_output(out);
        let graph = g.finish().unwrap();
        for mode in [RunMode::Eager, RunMode::Graph] {
            let mut cpu = CpuBackend::new();
            let mut pc = cpu.prepare(&graph).unwrap();
            cpu.write_bytes(&mut pc, kc.raw(), 0, &kb).unwrap();
            cpu.write_bytes(&mut pc, vc.raw(), 0, &vb).unwrap();
            let mut cuda = CudaBackend::new(dev.clone(), mode);
            let mut pg = cuda.prepare(&graph).unwrap();
            cuda.write_bytes(&mut pg, kc.raw(), 0, &kb).unwrap();
            cuda.write_bytes(&mut pg, vc.raw(), 0, &vb).unwrap();
            for (b, d) in &page_data {
                cpu.write_bytes(&mut pc, *b, 0, d).unwrap();
                cuda.write_bytes(&mut pg, *b, 0, d).unwrap();
            }
            // The last positions (splits of 256 keys, batches of 16 dealt to 8 warps): a split's
            // first key, the second warp's first batch, the first warp's second batch, and a
            // split's last key (with two tokens, the next split's first too).
            for position in [ctx - 2, 5000, ctx - 2, 1500, 0, 700, ctx - 2, 256, 272, 384, 511] {
                let qv: Vec<f32> = (0..tokens * heads * hd).map(|_| rng.symmetric()).collect();
                let kv: Vec<f32> = (0..tokens * kv_heads * hd).map(|_| rng.symmetric()).collect();
                let vv: Vec<f32> = (0..tokens * kv_heads * hd).map(|_| rng.symmetric()).collect();
                // A chunk's consecutive positions, or each sequence at its own length.
                let positions: Vec<u32> = (0..tokens)
                    .map(|t| match batched {
                        false => (position + t) as u32,
                        true => ((position + 1777 * t) % (ctx - 1)) as u32,
                    })
                    .collect();
                cuda.poison(&pg).unwrap();
                for (b, d) in [(q, &qv), (k, &kv), (v, &vv)] {
                    cpu.upload(&mut pc, b, d).unwrap();
                    cuda.upload(&mut pg, b, d).unwrap();
                }
                cpu.upload(&mut pc, pos, &positions).unwrap();
                cpu.run(&mut pc).unwrap();
                let want: Vec<f64> = cpu
                    .download::<f32>(&pc, out)
                    .unwrap()
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                cuda.upload(&mut pg, pos, &positions).unwrap();
                cuda.run(&mut pg).unwrap();
                let err = rel_l2(&cuda.download::<f32>(&pg, out).unwrap(), &want);
                println!(
                    "{mode:?} decode attention, {splits}, {tokens} tokens at position {position} of {ctx}: relative L2 error {err:e}"
                );
                assert!(
                    err <= TOL_INT8_L2,
                    "seed {seed} {mode:?} {splits}, {tokens} tokens at position {position}: relative L2 error {err:e}"
                );
            }
        }
    }
}

/// Each row drawn with its own settings (`SampleRows`): CUDA's tokens, generators and token
/// counts equal the CPU's (the host algorithm's) bit for bit, rows of every kind in one op:
/// greedy, top-k 1, 20 and 64, top-p, min-p, temperatures low and high, penalties from a row of
/// counts (and a counts row past the state, read as none); logits with ties; vocabularies below
/// one block's chunk, of real size, and large enough that the merge's candidates pass 48 KB of
/// shared memory; eagerly and as a graph, the output poisoned before each run.
#[test]
fn gpu_row_sampler_equals_the_cpu_sampler() {
    use kestrel_core::sample::{counts_of, draw_words, SamplingParams, DRAWN_WORDS};
    let Some(dev) = device_or_skip("gpu_row_sampler_equals_the_cpu_sampler") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    let kinds = [
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.95,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 64,
            min_p: 0.05,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.2,
            top_k: 1,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.5,
            min_p: 0.1,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.1,
            top_k: 50,
            repetition_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.2,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.5,
            ..Default::default()
        },
    ];
    for (vocab, rows) in [(1500, 7), (151_936, 13), (248_320, 5)] {
        let mut g = GraphBuilder::new();
        let logits = g.logits_input("logits", rows, vocab);
        let draws = g.draws_input("draws", rows);
        let counts = g.state("counts", DType::U32, [rows, vocab]);
        let out = g.sample_rows("sample_rows", logits, draws, counts);
        g.mark_output(out);
        let graph = g.finish().unwrap();
        let params: Vec<SamplingParams> = (0..rows).map(|r| kinds[(r + rows) % kinds.len()]).collect();
        // Penalised rows keep their counts in the state's rows in reverse; row 0 names one past it.
        let counts_row: Vec<Option<u32>> = (0..rows)
            .map(|r| match r {
                0 => Some(rows as u32),
                _ if params[r].has_penalties() => Some((rows - 1 - r) as u32),
                _ => None,
            })
            .collect();
        let start: Vec<u32> = (0..rows)
            .flat_map(|_| {
                counts_of(
                    &(0..60).map(|_| rng.range(0, vocab) as u32).collect::<Vec<_>>(),
                    vocab,
                )
            })
            .collect();
        for mode in [RunMode::Eager, RunMode::Graph] {
            let mut cpu = CpuBackend::new();
            let mut cuda = CudaBackend::new(dev.clone(), mode);
            let mut pc = cpu.prepare(&graph).unwrap();
            let mut pg = cuda.prepare(&graph).unwrap();
            cpu.upload(&mut pc, counts, &start).unwrap();
            cuda.upload(&mut pg, counts, &start).unwrap();
            let mut states: Vec<[u64; 4]> = (0..rows).map(|r| Rng::new(seed ^ r as u64).state()).collect();
            for step in 0..12 {
                let row: Vec<f32> = (0..rows * vocab)
                    .map(|_| (rng.symmetric() * 40.0).round() / 8.0)
                    .collect();
                let words: Vec<u32> = (params.iter().zip(&states))
                    .zip(&counts_row)
                    .flat_map(|((p, s), c)| draw_words(p, *s, *c))
                    .collect();
                cpu.upload(&mut pc, logits, &row).unwrap();
                cpu.upload(&mut pc, draws, &words).unwrap();
                cpu.run(&mut pc).unwrap();
                cuda.poison(&pg).unwrap();
                cuda.upload(&mut pg, logits, &row).unwrap();
                cuda.upload(&mut pg, draws, &words).unwrap();
                cuda.run(&mut pg).unwrap();
                let (a, b) = (
                    cpu.download::<u32>(&pc, out).unwrap(),
                    cuda.download::<u32>(&pg, out).unwrap(),
                );
                assert_eq!(b, a, "seed {seed} {mode:?} vocab {vocab} step {step}");
                for (s, o) in states.iter_mut().zip(a.chunks(DRAWN_WORDS)) {
                    *s = kestrel_core::sample::rng_state(&o[1..]);
                }
            }
            assert_eq!(
                cuda.download::<u32>(&pg, counts).unwrap(),
                cpu.download::<u32>(&pc, counts).unwrap(),
                "seed {seed} {mode:?} vocab {vocab}: the counts"
            );
        }
    }
}
