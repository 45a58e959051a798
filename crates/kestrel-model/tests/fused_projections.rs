//! q, k and v projections run as one product over their stacked weights when they are held
//! alike, and one by one (then concatenated) when they are not: a copy of the qwen3 fixture with
//! one layer's q_proj stored in f32 (the same values) takes the second path in that layer and
//! the first in the others, and computes the fixture's reference logits either way.

mod common;

use std::path::PathBuf;

use common::{dir, reference, rel_max_err};
use half::bf16;
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{Forward, ForwardSpec, ModelConfig, Session, Want, Weights};
use safetensors::tensor::{serialize_to_file, Dtype, TensorView};

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const WIDENED: &str = "model.layers.1.self_attn.q_proj.weight";

/// The qwen3 fixture with `WIDENED` stored as f32.
fn widened_copy() -> TempDir {
    let out = TempDir(std::env::temp_dir().join(format!("kestrel-fused-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&out.0);
    std::fs::create_dir_all(&out.0).unwrap();
    let src = dir("qwen3");
    for f in ["config.json", "generation_config.json"] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), out.0.join(f)).unwrap();
        }
    }
    let w = Weights::open(&src).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in w.names() {
        let t = w.get(name).unwrap();
        assert_eq!(t.dtype, DType::BF16, "{name}");
        if name == WIDENED {
            let wide: Vec<u8> = t
                .bytes
                .chunks(2)
                .flat_map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32().to_le_bytes())
                .collect();
            tensors.push((name.to_string(), Dtype::F32, t.shape.to_vec(), wide));
        } else {
            tensors.push((name.to_string(), Dtype::BF16, t.shape.to_vec(), t.bytes.to_vec()));
        }
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    serialize_to_file(views, None, &out.0.join("model.safetensors")).unwrap();
    out
}

fn linear_labels(d: &std::path::Path) -> Vec<String> {
    let (c, w) = (ModelConfig::from_dir(d).unwrap(), Weights::open(d).unwrap());
    let spec = ForwardSpec {
        all_logits: true,
        ..ForwardSpec::new(3, 8, DType::F32)
    };
    let f = Forward::build(&c, &w, spec).unwrap();
    f.graph
        .nodes
        .iter()
        .filter(|n| n.op.name() == "linear" && n.label.contains("self_attn"))
        .map(|n| n.label.clone())
        .collect()
}

#[test]
fn stacked_when_alike_one_by_one_when_not() {
    let fixture = linear_labels(&dir("qwen3"));
    assert!(
        fixture
            .iter()
            .all(|l| l.ends_with(".qkv_proj") || l.ends_with(".o_proj")),
        "{fixture:?}"
    );
    let copy = widened_copy();
    let labels = linear_labels(&copy.0);
    for p in ["q_proj", "k_proj", "v_proj"] {
        assert!(
            labels.contains(&format!("model.layers.1.self_attn.{p}")),
            "{labels:?}"
        );
    }
    assert!(labels.contains(&"model.layers.0.self_attn.qkv_proj".to_string()));
    let (tokens, want, _) = reference("qwen3");
    let mut s = Session::open(&copy.0, CpuBackend::new(), 64, DType::F32).unwrap();
    let err = rel_max_err(
        &s.step(&tokens, 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap(),
        &want,
    );
    assert!(err <= 1e-3, "{err:e}");
}
