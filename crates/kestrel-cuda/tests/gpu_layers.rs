//! Whole decoder layers (Qwen3-MoE, Qwen3-Next full attention, Qwen3-Next linear attention;
//! bf16 and 4-bit weights) on CUDA against the CPU backend: a prefill followed by decode steps,
//! comparing each step's output and the caches and states it leaves behind. Eager and graph.

use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_core::Backend;
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, RunMode};
use kestrel_testing::cases::{as_f64, rel_err, rel_l2, run_case, Case};
use kestrel_testing::gpu::device_or_skip;
use kestrel_testing::layers::{layer_sequence, Dims, LayerKind, OUTPUT, ROUTED};

/// Whole layers chain a dozen ops in f32 on both sides.
const TOL: f64 = 1e-3;
/// A bf16 or f16 cache entry may round to the neighbouring value when its f32 input differs in
/// the last bits: one ulp of bf16 relative to the largest entry.
const TOL_HALF: f64 = 8e-3;
/// Quantised layers: CUDA's one-token projections run on activations rounded to int8; compared
/// by relative L2 error.
const TOL_INT8_L2: f64 = 2e-2;

fn run_steps<B: Backend>(backend: &mut B, steps: &[Case]) -> Vec<Vec<Vec<u8>>> {
    steps
        .iter()
        .map(|s| run_case(backend, s).unwrap_or_else(|e| panic!("{}: {e}", s.name)))
        .collect()
}

#[test]
fn layers_match_the_cpu_backend() {
    let Some(dev) = device_or_skip("layers_match_the_cpu_backend") else {
        return;
    };
    let (mut rng, seed) = Rng::from_time();
    for kind in [
        LayerKind::Qwen3Moe,
        LayerKind::NextAttention,
        LayerKind::NextLinear,
    ] {
        for quant in [
            None,
            Some(QuantFormat::Q4),
            Some(QuantFormat::Q8),
            Some(QuantFormat::f32_scales(4, 32)),
            Some(QuantFormat::f32_scales(8, 16)),
        ] {
            let dims = Dims::small(quant);
            let tokens = 9;
            let x: Vec<f32> = (0..tokens * dims.hidden).map(|_| rng.symmetric()).collect();
            let steps = layer_sequence(kind, dims, rng.next_u64(), &x, 5);
            let cpu = run_steps(&mut CpuBackend::new(), &steps);
            let mut worst = 0f64;
            let mut flips = 0;
            for mode in [RunMode::Eager, RunMode::Graph] {
                let gpu = run_steps(&mut CudaBackend::new(dev.clone(), mode), &steps);
                for (step, (c, g)) in steps.iter().zip(cpu.iter().zip(&gpu)) {
                    // A near tie in the router can go the other way once activations are
                    // rounded upstream (int8): then the step's output legitimately differs.
                    let routed = step.checks.iter().position(|c| c.label == ROUTED);
                    let flipped = routed.is_some_and(|r| c[r] != g[r]);
                    if flipped {
                        assert!(
                            step.rounded_activations,
                            "seed {seed} {mode:?} {}: routing differs",
                            step.name
                        );
                        flips += 1;
                    }
                    for (check, (cb, gb)) in step.checks.iter().zip(c.iter().zip(g)) {
                        if flipped && (check.label == OUTPUT || check.label == ROUTED) {
                            continue;
                        }
                        let dtype = step.graph.decl(check.buf).dtype;
                        let (want, got) = (as_f64(cb, dtype), as_f64(gb, dtype));
                        let got: Vec<f32> = got.iter().map(|&v| v as f32).collect();
                        let (err, tol) = if step.rounded_activations {
                            (rel_l2(&got, &want), TOL_INT8_L2)
                        } else if dtype.size_in_bytes() == 2 {
                            (rel_err(&got, &want), TOL_HALF)
                        } else {
                            (rel_err(&got, &want), TOL)
                        };
                        worst = worst.max(err / tol);
                        assert!(
                            err <= tol,
                            "seed {seed} {mode:?} {} / {}: relative error {err:e}",
                            step.name,
                            check.label
                        );
                    }
                }
            }
            println!(
                "{kind:?} {quant:?}: worst error is {:.0}% of its bound; {flips} routing flips",
                100.0 * worst
            );
            assert!(
                flips <= 2,
                "seed {seed} {kind:?} {quant:?}: {flips} of {} steps routed differently",
                2 * steps.len()
            );
        }
    }
}
