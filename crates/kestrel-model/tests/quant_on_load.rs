//! Quantisation on load: the bf16 qwen3_moe fixture quantised by Kestrel to 4 bits (groups of
//! 32, routers at 8 bits) gives the logits of the MLX 4-bit fixture, whose weights the fixture
//! script quantised the same way and whose reference transformers computed from the
//! dequantised weights; a format that fits no matrix leaves them dense.

mod common;

use common::{dir, reference, rel_max_err};
use kestrel_core::quant::QuantFormat;
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{Session, Want};

#[test]
fn bf16_checkpoint_quantised_on_load_matches_the_mlx_reference() {
    let (tokens, want, _) = reference("qwen3_moe_mlx_q4");
    let q4g32 = QuantFormat::mlx(4, 32);
    let mut s = Session::open(&dir("qwen3_moe"), CpuBackend::new(), 64, DType::F32)
        .unwrap()
        .with_quant(Some(q4g32));
    let got = s
        .step(&tokens, 0, Want::AllLogits)
        .unwrap()
        .into_logits()
        .unwrap();
    let err = rel_max_err(&got, &want);
    println!("on-load q4 vs MLX reference: {err:.2e}");
    assert!(err <= 1e-3, "{err:e}");
    // And it is not the bf16 model's output: the quantisation happened.
    let (_, bf16_ref, _) = reference("qwen3_moe");
    assert!(rel_max_err(&got, &bf16_ref) > 1e-3);
}
