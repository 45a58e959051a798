//! `ModelConfig` against the config.json files of the supported architectures, in both
//! generations (`tests/configs/`, written by `scripts/fixtures/make-config-fixtures.py` and by hand), and
//! against malformed ones.

use kestrel_core::quant::QuantFormat;
use kestrel_core::rope::RopeScaling;
use kestrel_core::DType;
use kestrel_model::{Arch, LayerKind, MlpKind, ModelConfig, ModelError};

fn load(name: &str) -> ModelConfig {
    let path = kestrel_testing::fixtures::path("crates/kestrel-model/tests/configs").join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    ModelConfig::from_json(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn every_nth_full(layers: usize, n: usize) -> Vec<LayerKind> {
    (0..layers)
        .map(|i| {
            if (i + 1) % n == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect()
}

#[test]
fn qwen3_moe_reads_the_same_from_both_generations() {
    let (hub, v5) = (load("qwen3_moe_hub.json"), load("qwen3_moe_v5.json"));
    assert_eq!(
        hub, v5,
        "hub-style and transformers-5 files describe the same model"
    );
    let c = hub;
    assert_eq!(c.arch, Arch::Qwen3Moe);
    assert_eq!(
        (c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim),
        (2048, 48, 32, 4, 128)
    );
    assert_eq!(c.vocab, 151936);
    assert_eq!(c.dtype, Some(DType::BF16));
    assert_eq!(c.rope.theta, 1_000_000.0);
    assert_eq!(c.rope.partial_rotary_factor, 1.0);
    assert_eq!(c.rope.scaling, RopeScaling::None);
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(
        (moe.experts, moe.experts_per_token, moe.expert_intermediate),
        (128, 8, 768)
    );
    assert!(moe.norm_topk_prob);
    assert_eq!(moe.shared_intermediate, None);
    assert_eq!(c.moe_layers(), 48);
    assert!(c.layer_kinds.iter().all(|&k| k == LayerKind::FullAttention));
    assert!(c.linear_attn.is_none() && c.quant.is_none() && !c.nested_text && !c.tie_embeddings);
}

#[test]
fn qwen3_next_layer_pattern_from_interval_and_from_layer_types() {
    let (hub, v5) = (load("qwen3_next_hub.json"), load("qwen3_next_v5.json"));
    assert_eq!(hub, v5);
    let c = hub;
    assert_eq!(c.arch, Arch::Qwen3Next);
    assert_eq!(c.layer_kinds, every_nth_full(48, 4));
    assert_eq!((c.heads, c.kv_heads, c.head_dim), (16, 2, 256));
    assert_eq!(c.rope.theta, 10_000_000.0);
    assert_eq!(c.rope.partial_rotary_factor, 0.25);
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(
        (moe.experts, moe.experts_per_token, moe.expert_intermediate),
        (512, 10, 512)
    );
    assert_eq!(moe.shared_intermediate, Some(512));
    let la = c.linear_attn.as_ref().unwrap();
    assert_eq!(
        (
            la.key_heads,
            la.value_heads,
            la.key_head_dim,
            la.value_head_dim,
            la.conv_kernel
        ),
        (16, 32, 128, 128, 4)
    );
}

#[test]
fn qwen3_5_moe_reads_the_text_model_under_text_config() {
    let c = load("qwen3_5_moe_v5.json");
    assert_eq!(c.arch, Arch::Qwen35Moe);
    assert!(c.nested_text, "weights live under model.language_model.");
    assert_eq!((c.vocab, c.hidden, c.layers), (248320, 2048, 40));
    assert_eq!(c.layer_kinds, every_nth_full(40, 4));
    assert_eq!(c.mlp_kinds, vec![MlpKind::Moe; 40]);
    assert_eq!(c.intermediate, 0, "no dense blocks");
    let moe = c.moe.as_ref().unwrap();
    assert_eq!((moe.experts, moe.experts_per_token), (256, 8));
    assert!(moe.norm_topk_prob, "Qwen3.5 always renormalises");
    assert_eq!(c.rope.partial_rotary_factor, 0.25);
    assert_eq!(c.dtype, Some(DType::BF16));
}

#[test]
fn llama3_rope_scaling_from_both_generations() {
    let (hub, v5) = (load("llama_hub.json"), load("llama_v5.json"));
    for c in [&hub, &v5] {
        assert_eq!(c.arch, Arch::Llama);
        assert_eq!(c.head_dim, 128, "derived from hidden / heads when absent");
        assert_eq!(c.rope.theta, 500_000.0);
        assert_eq!(
            c.rope.scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0
            }
        );
        assert!(c.moe.is_none());
        assert_eq!(c.mlp_kinds, vec![MlpKind::Dense; 32]);
    }
    assert_eq!(hub.norm_eps, 1e-5);
}

#[test]
fn qwen3_dense() {
    let c = load("qwen3_v5.json");
    assert_eq!(c.arch, Arch::Qwen3);
    assert_eq!(
        (c.hidden, c.intermediate, c.layers, c.kv_heads),
        (4096, 12288, 36, 8)
    );
    assert!(c.moe.is_none());
}

#[test]
fn mlx_quantisation_with_router_overrides() {
    let c = load("qwen3_moe_mlx_q4.json");
    let q = c.quant.as_ref().unwrap();
    assert_eq!(q.default, QuantFormat::Q4);
    assert_eq!(q.format_for("model.layers.0.mlp.gate"), Some(QuantFormat::Q8));
    assert_eq!(q.format_for("model.layers.5.mlp.gate"), Some(QuantFormat::Q4));
    assert_eq!(q.format_for("model.embed_tokens"), Some(QuantFormat::Q4));
}

fn edit(name: &str, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let path = kestrel_testing::fixtures::path("crates/kestrel-model/tests/configs").join(name);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    v.to_string()
}

#[test]
fn sparse_step_and_mlp_only_layers_pick_dense_layers() {
    let text = edit("qwen3_moe_hub.json", |m| {
        m.insert("decoder_sparse_step".into(), 2.into());
        m.insert("mlp_only_layers".into(), serde_json::json!([3]));
    });
    let c = ModelConfig::from_json(&text).unwrap();
    // Layer i is MoE when (i + 1) % 2 == 0 and i is not 3.
    assert_eq!(
        &c.mlp_kinds[..6],
        &[
            MlpKind::Dense,
            MlpKind::Moe,
            MlpKind::Dense,
            MlpKind::Dense,
            MlpKind::Dense,
            MlpKind::Moe
        ]
    );
    assert_eq!(c.moe_layers(), 23);
}

#[test]
fn yarn_defaults_follow_transformers() {
    let text = edit("qwen3_moe_hub.json", |m| {
        m.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        );
    });
    let c = ModelConfig::from_json(&text).unwrap();
    assert_eq!(
        c.rope.scaling,
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32768.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true
        }
    );
}

#[test]
fn errors_name_what_is_wrong() {
    let unknown = edit("qwen3_v5.json", |m| {
        m.insert("model_type".into(), "mamba".into());
    });
    let e = ModelConfig::from_json(&unknown).unwrap_err();
    assert!(matches!(e, ModelError::UnknownArch { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("mamba") && msg.contains("qwen3_moe") && msg.contains("llama"),
        "{msg}"
    );

    let missing = edit("qwen3_v5.json", |m| {
        m.remove("hidden_size");
    });
    let msg = ModelConfig::from_json(&missing).unwrap_err().to_string();
    assert!(msg.contains("hidden_size") && msg.contains("missing"), "{msg}");

    let wrong_type = edit("qwen3_v5.json", |m| {
        m.insert("num_hidden_layers".into(), "many".into());
    });
    let msg = ModelConfig::from_json(&wrong_type).unwrap_err().to_string();
    assert!(msg.contains("num_hidden_layers"), "{msg}");

    let rope = edit("llama_hub.json", |m| {
        m.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "longrope", "factor": 2.0}),
        );
    });
    let msg = ModelConfig::from_json(&rope).unwrap_err().to_string();
    assert!(msg.contains("longrope"), "{msg}");

    let layers = edit("qwen3_next_v5.json", |m| {
        m.insert("layer_types".into(), serde_json::json!(["full_attention"]));
    });
    let msg = ModelConfig::from_json(&layers).unwrap_err().to_string();
    assert!(msg.contains("layer_types") && msg.contains("48"), "{msg}");

    let gptq = edit("qwen3_v5.json", |m| {
        m.insert(
            "quantization_config".into(),
            serde_json::json!({"quant_method": "gptq", "bits": 4}),
        );
    });
    let msg = ModelConfig::from_json(&gptq).unwrap_err().to_string();
    assert!(msg.contains("gptq"), "{msg}");

    let heads = edit("qwen3_v5.json", |m| {
        m.insert("num_key_value_heads".into(), 5.into());
    });
    let msg = ModelConfig::from_json(&heads).unwrap_err().to_string();
    assert!(msg.contains("num_key_value_heads"), "{msg}");

    assert!(matches!(ModelConfig::from_json("{"), Err(ModelError::Json(_))));
}

#[test]
fn from_dir_names_the_file() {
    let dir = std::env::temp_dir().join(format!("kestrel-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = ModelConfig::from_dir(&dir).unwrap_err();
    assert!(e.to_string().contains("config.json"), "{e}");
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"qwen3\"}").unwrap();
    let msg = ModelConfig::from_dir(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("config.json") && msg.contains("hidden_size"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_layer_count_past_any_model_is_refused_before_allocating() {
    // Found by the config_json fuzz target: the per-layer lists were allocated for 10^15 layers
    // (an allocation failure aborts the process).
    let crash = r#"{
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "a@ttention_dropout": 0.0,
  "bos_n_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "pnm_toork_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 1000000000000123,
  "num_ke_heads": 4,
  "output_router_logits": false,
  "rms_norm_epsze": 151936
}
"#;
    let msg = ModelConfig::from_json(crash).unwrap_err().to_string();
    assert!(
        msg.contains("num_hidden_layers") && msg.contains("1000000000000123"),
        "{msg}"
    );
}

#[test]
fn a_head_wider_than_any_model_is_refused_before_its_rotary_table() {
    // Found by the config_json fuzz target: no head_dim and a hidden size of 22,222,222,462 over
    // 4 heads imply heads of 5.5 billion dimensions, and the rotary table built for them took
    // seconds and gigabytes (more aborts the process).
    let crash = r#"{
  "architectures": [
    "Qwen3_5MoeForConditionalGeneration"
  ],
  "dtype": "bfloat16",
  "image_token_id": 248056,
  "model_type": "qwen3_5_moe",
  "text_config": {
    "attention_bias": false,
    "attention_dropout": 0.0,
    "pad_token_idbos_token_id": 1,
    "eos_token_id": 2,
    "head_di18446744073709551615m": 30,
    "hidden_act": "silu",
    "hidden_size": 22222222462,
    "initivalu;e_heads": 4,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 128,
    "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_experts": 0,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "numAkey_value_heads": 2,
    "output_router_logits": false,
    "pad_token_id": 0,
    "tartial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
      "mr_rotary_factor": 0.25,
      "rope_theta": 10000000.0,
      "rope_type": "default"
    },
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 64,
    "tie_word_embeddings": false,
    "use_cache": true,
    "vocab_size": 256
  },
  "tie_word_embeddings": false,
  "transformers_version": "5.17.0",
  "video_token_id": 248057,
  "vision_confin_end_token_id": 248054,
  "vision_start_token_id": 248053
}
"#;
    let msg = ModelConfig::from_json(crash).unwrap_err().to_string();
    assert!(msg.contains("head_dim") && msg.contains("5555555615"), "{msg}");
}

#[test]
fn a_linear_attention_without_a_convolution_window_is_refused() {
    // A zero window made `inspect` subtract past zero (a panic in a debug build).
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity/qwen3_next");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    c["linear_conv_kernel_dim"] = 0.into();
    let msg = ModelConfig::from_json(&c.to_string()).unwrap_err().to_string();
    assert!(msg.contains("linear_conv_kernel_dim"), "{msg}");
}
