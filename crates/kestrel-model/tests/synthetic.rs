//! Synthetic models: for every architecture the in-memory layout is, tensor for tensor (names,
//! dtypes, shapes) and in its `quantization` exceptions, what `quantize_dir` writes from a real
//! checkpoint of that configuration (whose output for qwen3_moe is the MLX fixture byte for
//! byte); the same seed gives the same weights; a named real configuration loads and computes
//! finite, input-dependent logits on the CPU backend.

mod common;

use std::collections::BTreeMap;

use common::dir;
use kestrel_core::quant::QuantFormat;
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{quantize_dir, synthetic_model, synthetic_weights, ModelConfig, Session, Want, Weights};

fn out_dir(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("kestrel-synthetic-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// Name → (dtype, shape) of every tensor but a vision tower's.
fn layout(w: &Weights) -> BTreeMap<String, (DType, Vec<usize>)> {
    w.names()
        .into_iter()
        .filter(|n| !n.starts_with("model.visual."))
        .map(|n| {
            let t = w.get(n).unwrap();
            (n.to_string(), (t.dtype, t.shape.to_vec()))
        })
        .collect()
}

fn check_layout(fixture: &str, format: QuantFormat) {
    let out = out_dir(&format!("{fixture}-{}", format.group_size));
    quantize_dir(&dir(fixture), &out, format).unwrap();
    let dense = ModelConfig::from_dir(&dir(fixture)).unwrap();
    let (ours, quant) = synthetic_weights(&dense, format, 1).unwrap();
    let theirs = Weights::open(&out).unwrap();
    let (a, b) = (layout(&ours), layout(&theirs));
    for (name, want) in &b {
        assert_eq!(a.get(name), Some(want), "{fixture}: {name}");
    }
    assert_eq!(
        a.len(),
        b.len(),
        "{fixture}: extra tensors {:?}",
        a.keys().filter(|n| !b.contains_key(*n)).collect::<Vec<_>>()
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(quant, cfg["quantization"], "{fixture}");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn layout_equals_quantize_dir_for_every_architecture() {
    let g32 = QuantFormat::mlx(4, 32);
    for fixture in ["llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe"] {
        check_layout(fixture, g32);
    }
    // Groups of 64 leave the dense models' down projections (96 columns) unquantised.
    for fixture in ["llama", "qwen3"] {
        check_layout(fixture, QuantFormat::Q4);
    }
    // Experts 32 wide do not divide into groups of 64: an error naming them.
    let dense = ModelConfig::from_dir(&dir("qwen3_moe")).unwrap();
    let err = synthetic_weights(&dense, QuantFormat::Q4, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("switch_mlp") && err.contains("groups of 64"),
        "{err}"
    );
}

#[test]
fn a_seed_gives_the_same_weights() {
    let dense = ModelConfig::from_dir(&dir("qwen3_next")).unwrap();
    let f = QuantFormat::Q8;
    let g = QuantFormat { group_size: 32, ..f };
    let (a, b, c) = (
        synthetic_weights(&dense, g, 5).unwrap().0,
        synthetic_weights(&dense, g, 5).unwrap().0,
        synthetic_weights(&dense, g, 6).unwrap().0,
    );
    let name = "model.layers.0.mlp.switch_mlp.up_proj.weight";
    assert!(a.get(name).unwrap().bytes == b.get(name).unwrap().bytes);
    assert!(a.get(name).unwrap().bytes != c.get(name).unwrap().bytes);
}

#[test]
fn unknown_names_and_layer_counts_are_errors() {
    let err = synthetic_model("qwen9", None, QuantFormat::Q4, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("qwen3-30b-a3b"), "{err}");
    let err = synthetic_model("qwen3-30b-a3b", Some(49), QuantFormat::Q4, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("48 layers"), "{err}");
}

#[test]
fn a_real_configuration_runs_on_the_cpu() {
    // One layer of each MoE architecture with full attention or linear attention.
    for name in ["qwen3-30b-a3b", "qwen3-next-80b-a3b"] {
        let (config, weights) = synthetic_model(name, Some(1), QuantFormat::Q4, 3).unwrap();
        assert_eq!(config.layers, 1);
        assert!(config.quant.is_some(), "{name}: quantised config");
        let vocab = config.vocab;
        let mut s = Session::new(config, weights, CpuBackend::new(), 8, DType::F32);
        let logits = s
            .step(&[17, 4242, 99], 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap();
        assert_eq!(logits.len(), 3 * vocab);
        for row in logits.chunks(vocab) {
            let mean = row.iter().sum::<f32>() / vocab as f32;
            let std = (row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / vocab as f32).sqrt();
            assert!(row.iter().all(|v| v.is_finite()), "{name}: finite logits");
            assert!(std > 0.05 && std < 50.0, "{name}: logit spread {std}");
        }
        assert!(
            logits[..vocab] != logits[vocab..2 * vocab],
            "{name}: rows depend on the input"
        );
    }
}
