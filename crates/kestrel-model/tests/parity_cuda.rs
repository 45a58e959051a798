//! End-to-end parity on the CUDA backend (graph replay, bf16 KV caches) against transformers:
//! per position cosine >= 0.999 with the fp32 reference logits and top-1 agreement >= 98%, in
//! prefill and in token-by-token decode, plus the greedy continuation's agreement reported (and
//! with f32 caches required to be identical); and
//! a longer prompt against the CPU backend, for the many-token paths. Skips with a notice without a CUDA device (fails under `KESTREL_REQUIRE_GPU=1`).

mod common;

use common::{
    describe_positions, dir, min_cosine, reference, rel_max_err, run, top1_agreement, top1_agreement_or_tie,
    FIXTURES, WIDE,
};
use kestrel_core::{Backend, DType};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, Exact, RunMode};
use kestrel_model::{Forward, ForwardSpec, ModelConfig, Weights};
use kestrel_testing::gpu::device_or_skip;

#[test]
fn every_fixture_matches_transformers_on_cuda() {
    let Some(dev) = device_or_skip("every_fixture_matches_transformers_on_cuda") else {
        return;
    };
    for name in FIXTURES {
        let (_, want, cont) = reference(name);
        let (prefill, decode, generated) = run(
            name,
            || CudaBackend::new(dev.clone(), RunMode::Graph),
            DType::BF16,
        );
        for (mode, got) in [("prefill", &prefill), ("decode", &decode)] {
            let (cos, top1) = (min_cosine(got, &want), top1_agreement(got, &want));
            println!(
                "{name}: {mode} min cosine {cos:.6}, top-1 agreement {:.1}%",
                100.0 * top1
            );
            println!("{name}: {mode} {}", describe_positions(got, &want));
            assert!(cos >= 0.999, "{name}: {mode} cosine {cos}");
            assert!(top1 >= 0.98, "{name}: {mode} top-1 agreement {top1}");
        }
        let same = generated.iter().zip(&cont).take_while(|(a, b)| a == b).count();
        println!(
            "{name}: greedy continuation agrees for {same} of {} tokens",
            cont.len()
        );
        // With f32 caches CUDA continues as transformers does, token for token, as the CPU
        // does; bf16 caches may part from it at a near-tie of the random fixture's logits
        // (qwen3_5_moe after 4 tokens, on the CPU with bf16 caches too).
        let (_, _, generated) = run(name, || CudaBackend::new(dev.clone(), RunMode::Graph), DType::F32);
        let same = generated.iter().zip(&cont).take_while(|(a, b)| a == b).count();
        println!(
            "{name}: with f32 caches, greedy continuation agrees for {same} of {} tokens",
            cont.len()
        );
        assert_eq!(generated, cont, "{name}: greedy continuation with f32 caches");
    }
}

/// One prefill of `tokens` through `Forward` on `backend`, all logits, with the norm outputs
/// that feed projections stored as `projection_inputs`, bf16 KV caches.
fn prefill_logits<B: Backend>(backend: B, name: &str, tokens: &[u32], projection_inputs: DType) -> Vec<f32> {
    prefill_logits_with(backend, name, tokens, projection_inputs, DType::BF16)
}

/// [`prefill_logits`] with KV caches of `cache`.
fn prefill_logits_with<B: Backend>(
    mut backend: B,
    name: &str,
    tokens: &[u32],
    projection_inputs: DType,
    cache: DType,
) -> Vec<f32> {
    let d = dir(name);
    let (c, w) = (ModelConfig::from_dir(&d).unwrap(), Weights::open(&d).unwrap());
    let spec = ForwardSpec {
        projection_inputs,
        all_logits: true,
        ..ForwardSpec::new(tokens.len(), 64, cache)
    };
    let f = Forward::build(&c, &w, spec).unwrap();
    let mut p = backend.prepare(&f.graph).unwrap();
    f.upload(&w, &mut backend, &mut p).unwrap();
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    backend.upload(&mut p, f.tokens, tokens).unwrap();
    backend.upload(&mut p, f.positions, &positions).unwrap();
    f.write_pages(&mut backend, &mut p).unwrap();
    backend.run(&mut p).unwrap();
    let mut out = vec![0u8; f.graph.decl(f.logits).byte_len()];
    backend.read_bytes(&p, f.logits.raw(), &mut out).unwrap();
    bytemuck::pod_collect_to_vec(&out)
}

/// A prompt long enough for the many-token paths, against the CPU backend (the fixtures' 12
/// tokens stay under them): projections as tensor-core products on bf16 norm outputs, routed
/// experts as grouped GEMMs where their shapes are whole tiles. The fixture's tokens repeated
/// to 40, as one prefill of the graph a CUDA session builds for it (norm outputs for
/// projections in bf16, `Backend::projection_input_dtype`), on both backends. Against the f32
/// graph instead, the hybrids' tiny random routers flip an expert at a few positions (cosine
/// 0.91 there), which compares the rounding, not the backends.
#[test]
fn long_prompts_match_the_cpu_backend_on_cuda() {
    let Some(dev) = device_or_skip("long_prompts_match_the_cpu_backend_on_cuda") else {
        return;
    };
    for name in FIXTURES {
        let (tokens, _, _) = reference(name);
        let long: Vec<u32> = tokens.iter().cycle().take(40).copied().collect();
        let cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
        let pi = cuda.projection_input_dtype(long.len());
        assert_eq!(pi, DType::BF16, "40 tokens take the tensor-core products on CUDA");
        let gpu = prefill_logits(cuda, name, &long, pi);
        let cpu = prefill_logits(CpuBackend::new(), name, &long, pi);
        let (cos, top1) = (min_cosine(&gpu, &cpu), top1_agreement(&gpu, &cpu));
        // The fixtures' random logits are nearly flat: where the two picks differ, the CUDA
        // pick must be a near-tie on the CPU (within 1% of the row's range).
        let tie = top1_agreement_or_tie(&gpu, &cpu, 0.01);
        println!(
            "{name}: 40-token prefill against the CPU: min cosine {cos:.6}, top-1 agreement {:.1}% ({:.1}% with near-ties)",
            100.0 * top1,
            100.0 * tie
        );
        assert!(cos >= 0.999, "{name}: cosine {cos}");
        assert!(tie == 1.0, "{name}: top-1 agreement with near-ties {tie}");
    }
}

/// The wider hybrids (48-token prompts, hidden 128, head_dim 64, 16 experts top-4) against
/// transformers on CUDA, every position reported. In exact mode (`Exact::ALL`, f32 caches) CUDA
/// gives the reference's logits, prefill and decode, top-1 at every position. The fast paths
/// (bf16 activations into many-token products and grouped expert GEMMs, bf16 caches) part from
/// it where these random routers' choices are near ties (qwen3_next_wide: 43 of 48 positions in
/// prefill; see `wide_hybrids_prefill_roundings_one_at_a_time` for which rounding does it).
#[test]
fn wide_hybrids_match_transformers_on_cuda() {
    let Some(dev) = device_or_skip("wide_hybrids_match_transformers_on_cuda") else {
        return;
    };
    for name in WIDE {
        let (_, want, cont) = reference(name);
        let exact = || CudaBackend::new(dev.clone(), RunMode::Graph).with_exact(Exact::ALL);
        let (prefill, decode, generated) = run(name, exact, DType::F32);
        for (mode, got) in [("prefill", &prefill), ("decode", &decode)] {
            let err = rel_max_err(got, &want);
            println!(
                "{name}: exact {mode}: max error {err:.2e}; {}",
                describe_positions(got, &want)
            );
            assert!(err <= 1e-3, "{name}: exact {mode} error {err:.2e}");
            assert_eq!(top1_agreement(got, &want), 1.0, "{name}: exact {mode} top-1");
        }
        assert_eq!(generated, cont, "{name}: exact greedy continuation");
        let fast = || CudaBackend::new(dev.clone(), RunMode::Graph);
        let (prefill, decode, _) = run(name, fast, DType::BF16);
        for (mode, got) in [("prefill", &prefill), ("decode", &decode)] {
            let top1 = top1_agreement(got, &want);
            println!("{name}: fast {mode}: {}", describe_positions(got, &want));
            assert!(top1 >= 0.85, "{name}: fast {mode} top-1 agreement {top1}");
        }
    }
}

/// Which rounding parts CUDA prefill from transformers on the wider hybrids: one prefill of the
/// 48-token prompt with each fast path switched off in turn (`Exact`: the many-token products'
/// bf16 activations, the grouped expert GEMMs' bf16 activations), with KV caches in bf16 or
/// f32. Each line gives the per-position errors against the fp32 reference, so the rounding
/// that moves them is the one whose switch does.
#[test]
fn wide_hybrids_prefill_roundings_one_at_a_time() {
    let Some(dev) = device_or_skip("wide_hybrids_prefill_roundings_one_at_a_time") else {
        return;
    };
    let switches = [
        ("none switched off", Exact::default()),
        (
            "projections f32",
            Exact {
                projections: true,
                ..Exact::default()
            },
        ),
        (
            "experts f32",
            Exact {
                experts: true,
                ..Exact::default()
            },
        ),
        ("both f32", Exact::ALL),
    ];
    for name in WIDE {
        let (tokens, want, _) = reference(name);
        for cache in [DType::BF16, DType::F32] {
            for (what, exact) in switches {
                let cuda = CudaBackend::new(dev.clone(), RunMode::Graph).with_exact(exact);
                let pi = cuda.projection_input_dtype(tokens.len());
                let got = prefill_logits_with(cuda, name, &tokens, pi, cache);
                println!(
                    "{name}: caches {cache}, {what}: max error {:.2e}; {}",
                    rel_max_err(&got, &want),
                    describe_positions(&got, &want)
                );
            }
        }
    }
}
