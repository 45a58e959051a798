//! Checkpoints stored in f32 and f16 load and compute like the bf16 one they were converted from:
//! every tensor of the qwen3_moe fixture widened to f32 (the same values: the same logits), or
//! narrowed to f16 (within the parity bound of the reference).

mod common;

use common::{dir, reference, rel_max_err, TempDir};
use half::{bf16, f16};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{Session, Want, Weights};
use safetensors::tensor::{serialize_to_file, Dtype, TensorView};

/// The fixture `name` with every bf16 tensor converted to `to`, and config.json's dtype to match.
fn converted(name: &str, to: Dtype) -> TempDir {
    let out = TempDir::new(&format!("dtype-{name}-{to:?}"));
    let src = dir(name);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["dtype"] = if to == Dtype::F32 { "float32" } else { "float16" }.into();
    std::fs::write(out.0.join("config.json"), config.to_string()).unwrap();
    let w = Weights::open(&src).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in w.names() {
        let t = w.get(name).unwrap();
        assert_eq!(t.dtype, DType::BF16, "{name}");
        let values = t
            .bytes
            .chunks(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32());
        let bytes: Vec<u8> = match to {
            Dtype::F32 => values.flat_map(|v| v.to_le_bytes()).collect(),
            _ => values.flat_map(|v| f16::from_f32(v).to_le_bytes()).collect(),
        };
        tensors.push((name.to_string(), t.shape.to_vec(), bytes));
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, s, b)| (n.clone(), TensorView::new(to, s.clone(), b).unwrap()))
        .collect();
    serialize_to_file(views, None, &out.0.join("model.safetensors")).unwrap();
    out
}

#[test]
fn f32_and_f16_checkpoints() {
    let (tokens, want, _) = reference("qwen3_moe");
    let logits = |d: &std::path::Path| {
        Session::open(d, CpuBackend::new(), 64, DType::F32)
            .unwrap()
            .step(&tokens, 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap()
    };
    let base = logits(&dir("qwen3_moe"));
    let wide = converted("qwen3_moe", Dtype::F32);
    let err = rel_max_err(&logits(&wide.0), &base);
    assert!(err <= 1e-6, "f32: {err:e}");
    let narrow = converted("qwen3_moe", Dtype::F16);
    let err = rel_max_err(&logits(&narrow.0), &want);
    assert!(err <= 1e-3, "f16: {err:e}");
}

/// The same checkpoints on CUDA (graph replay, bf16 caches) against the reference: the parity
/// bounds. Skips without a device (fails under `KESTREL_REQUIRE_GPU=1`).
#[test]
fn f32_and_f16_checkpoints_on_cuda() {
    use kestrel_cuda::{CudaBackend, RunMode};
    use kestrel_testing::gpu::device_or_skip;
    let Some(dev) = device_or_skip("f32_and_f16_checkpoints_on_cuda") else {
        return;
    };
    let (tokens, want, _) = reference("qwen3_moe");
    for to in [Dtype::F32, Dtype::F16] {
        let d = converted("qwen3_moe", to);
        let mut s = Session::open(
            &d.0,
            CudaBackend::new(dev.clone(), RunMode::Graph),
            64,
            DType::BF16,
        )
        .unwrap();
        let got = s
            .step(&tokens, 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap();
        let (cos, top1) = (
            common::min_cosine(&got, &want),
            common::top1_agreement(&got, &want),
        );
        println!("{to:?} on CUDA: min cosine {cos:.6}, top-1 {:.1}%", 100.0 * top1);
        assert!(cos >= 0.999 && top1 >= 0.98, "{to:?}: cosine {cos}, top-1 {top1}");
    }
}
