//! Whole decoder layers on the CPU: a prefill of every token in one pass must equal a shorter
//! prefill followed by single-token decode steps (KV caches, conv and recurrent states carried
//! between graphs by label; chunked delta rule in prefill, recurrent in decode).

use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_cpu::CpuBackend;
use kestrel_testing::cases::{f32s, rel_err, run_case};
use kestrel_testing::layers::{layer_case, layer_sequence, Dims, LayerKind, OUTPUT};

/// The layer's output among the checked buffers (the others are caches and states).
fn output_index(case: &kestrel_testing::cases::Case) -> usize {
    case.checks
        .iter()
        .position(|c| c.label == OUTPUT)
        .expect("layer output is checked")
}

#[test]
fn prefill_equals_prefill_then_decode_for_every_layer_kind() {
    let (mut rng, seed) = Rng::from_time();
    for kind in [
        LayerKind::Qwen3Moe,
        LayerKind::NextAttention,
        LayerKind::NextLinear,
    ] {
        for quant in [None, Some(QuantFormat::Q4), Some(QuantFormat::f32_scales(8, 16))] {
            let dims = Dims::small(quant);
            let tokens = 7;
            let x: Vec<f32> = (0..tokens * dims.hidden).map(|_| rng.symmetric()).collect();
            let w = rng.next_u64();
            let one_shot = layer_case(kind, dims, w, &x, 0, true);
            let whole = f32s(&run_case(&mut CpuBackend::new(), &one_shot).unwrap()[output_index(&one_shot)]);
            let mut cpu = CpuBackend::new();
            let mut rows = Vec::new();
            for step in layer_sequence(kind, dims, w, &x, 3) {
                let out = run_case(&mut cpu, &step).unwrap();
                rows.extend(f32s(&out[output_index(&step)]));
            }
            let want: Vec<f64> = whole.iter().map(|&v| v as f64).collect();
            let err = rel_err(&rows, &want);
            assert!(
                err < 1e-4,
                "seed {seed} {kind:?} {quant:?}: prefill+decode differs from prefill by {err:e}"
            );
            assert!(whole.iter().all(|v| v.is_finite()));
        }
    }
}
