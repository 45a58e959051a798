//! The transformers-written checkpoints in `tests/parity/` (made by
//! `scripts/fixtures/make-parity-fixtures.py` on a machine with torch) load: every config parses to the
//! sizes the script set, the weights open, every MoE layer's experts pack (bf16 from the
//! transformers files, 4-bit as stored from the MLX one), and the references have the expected
//! shapes. The logit comparisons themselves come with the model graphs.

use std::path::PathBuf;

use kestrel_core::ir::{ExpertFormat, ExpertLayout};
use kestrel_core::quant::QuantFormat;
use kestrel_core::DType;
use kestrel_model::{
    expert_source, pack_experts, Arch, ExpertSource, LayerKind, MlpKind, ModelConfig, Weights,
};

fn dir(name: &str) -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name)
}

const FIXTURES: [(&str, Arch); 6] = [
    ("qwen3_moe", Arch::Qwen3Moe),
    ("qwen3_moe_mlx_q4", Arch::Qwen3Moe),
    ("qwen3_next", Arch::Qwen3Next),
    ("qwen3_5_moe", Arch::Qwen35Moe),
    ("qwen3", Arch::Qwen3),
    ("llama", Arch::Llama),
];

#[test]
fn every_fixture_loads_and_its_experts_pack() {
    for (name, arch) in FIXTURES {
        let d = dir(name);
        let c = ModelConfig::from_dir(&d).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c.arch, arch, "{name}");
        assert_eq!(
            (c.vocab, c.hidden, c.heads, c.kv_heads, c.head_dim),
            (256, 64, 4, 2, 16),
            "{name}"
        );
        assert_eq!(c.dtype, Some(DType::BF16), "{name}");
        let w = Weights::open(&d).unwrap_or_else(|e| panic!("{name}: {e}"));
        let prefix = if c.nested_text {
            "model.language_model"
        } else {
            "model"
        };
        assert!(w.contains(&format!("{prefix}.embed_tokens.weight")), "{name}");
        assert!(w.contains("lm_head.weight"), "{name}");
        let format = match &c.quant {
            Some(q) => ExpertFormat::Quant(q.default),
            None => ExpertFormat::Bf16,
        };
        for (i, kind) in c.mlp_kinds.iter().enumerate() {
            if *kind != MlpKind::Moe {
                continue;
            }
            let moe = c.moe.as_ref().unwrap();
            let layout = ExpertLayout::uniform(moe.experts, c.hidden, moe.expert_intermediate, format);
            let mlp = format!("{prefix}.layers.{i}.mlp");
            let src = expert_source(&w, &mlp).unwrap();
            let want = if c.quant.is_some() {
                ExpertSource::MlxSwitch
            } else {
                ExpertSource::PerExpert
            };
            assert_eq!(src, want, "{name} layer {i}");
            let packed = pack_experts(&w, &mlp, &layout).unwrap_or_else(|e| panic!("{name} layer {i}: {e}"));
            assert_eq!(packed.len(), layout.total_bytes());
            assert!(
                packed.iter().any(|&b| b != 0),
                "{name} layer {i}: experts packed as zeros"
            );
        }
        let r = Weights::open(&d.join("reference")).unwrap();
        let (tokens, logits) = (r.get("tokens").unwrap(), r.get("logits").unwrap());
        assert_eq!(
            (tokens.dtype, tokens.shape),
            (DType::I64, &[12usize][..]),
            "{name}"
        );
        assert_eq!(
            (logits.dtype, logits.shape),
            (DType::F32, &[12usize, 256][..]),
            "{name}"
        );
        let greedy: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("reference/greedy.json")).unwrap()).unwrap();
        assert_eq!(greedy["continuation"].as_array().unwrap().len(), 24, "{name}");
    }
}

#[test]
fn fixture_structure_matches_the_script() {
    let c = ModelConfig::from_dir(&dir("qwen3_moe")).unwrap();
    // mlp_only_layers = [1]: layers 0 and 2 are MoE.
    assert_eq!(c.mlp_kinds, vec![MlpKind::Moe, MlpKind::Dense, MlpKind::Moe]);
    let q = ModelConfig::from_dir(&dir("qwen3_moe_mlx_q4"))
        .unwrap()
        .quant
        .unwrap();
    let q4g32 = QuantFormat::mlx(4, 32);
    assert_eq!(q.default, q4g32);
    assert_eq!(q.format_for("model.layers.0.mlp.gate").unwrap().bits, 8);
    for name in ["qwen3_next", "qwen3_5_moe"] {
        let c = ModelConfig::from_dir(&dir(name)).unwrap();
        use LayerKind::*;
        assert_eq!(
            c.layer_kinds,
            vec![LinearAttention, FullAttention, LinearAttention, FullAttention],
            "{name}"
        );
        assert_eq!(c.rope.partial_rotary_factor, 0.25, "{name}");
        assert_eq!(c.moe.as_ref().unwrap().shared_intermediate, Some(64), "{name}");
    }
    assert!(ModelConfig::from_dir(&dir("qwen3_5_moe")).unwrap().nested_text);
}
