//! `kestrel inspect --json` on the fixtures: parameter counts worked out by hand from the sizes
//! `scripts/fixtures/make-parity-fixtures.py` sets, the same count for a model and its MLX 4-bit copy, the
//! vision tower of the multimodal checkpoint left out, and the memory of caches and states; a
//! GGUF file counted as its directory is, its size on disk the file's; the bf16 copies of
//! projections the CUDA backend keeps.

use std::process::Command;

fn inspect(name: &str) -> serde_json::Value {
    inspect_with(name, &[])
}

fn inspect_with(name: &str, extra: &[&str]) -> serde_json::Value {
    inspect_env(name, extra, &[])
}

/// `inspect_with` with the variables `env` set.
fn inspect_env(name: &str, extra: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    inspect_path(
        &kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name),
        extra,
        env,
    )
}

fn inspect_path(dir: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "inspect",
            "--model",
            dir.to_str().unwrap(),
            "--ctx",
            "64",
            "--json",
        ])
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(String::from_utf8(o.stdout).unwrap().lines().last().unwrap()).unwrap()
}

#[test]
fn counts_and_memory_match_the_fixture_sizes() {
    // qwen3_moe: embedding and lm_head 2 * 256 * 64; per layer attention 4096 + 2048 + 2048 +
    // 4096, head norms 2 * 16, layer norms 2 * 64; layers 0 and 2 MoE (router 8 * 64, experts
    // 8 * 3 * 32 * 64), layer 1 dense (3 * 96 * 64); final norm 64.
    let experts = 2 * 8 * 3 * 32 * 64;
    let total = 2 * 256 * 64 + 3 * (12288 + 32 + 128) + 2 * 512 + experts + 3 * 96 * 64 + 64;
    let v = inspect("qwen3_moe");
    assert_eq!(v["parameters"], total);
    assert_eq!(
        v["active_parameters_per_token"],
        total - experts + experts * 2 / 8
    );
    // A decode step reads every bf16 weight but the experts and the embedding table, two of
    // eight experts, and one embedding row.
    assert_eq!(v["weight_bytes"], 2 * total);
    assert_eq!(
        v["active_bytes_per_token"],
        2 * (total - experts + experts * 2 / 8 - 256 * 64 + 64)
    );
    assert_eq!(v["kv_cache_bytes"], 3 * 2 * 2 * 64 * 16 * 2);
    assert_eq!(v["recurrent_state_bytes"], 0);
    let q = inspect("qwen3_moe_mlx_q4");
    assert_eq!(
        q["parameters"], total,
        "packed 4-bit words count as the values they hold"
    );
    let f = q["formats"].as_object().unwrap();
    assert!(
        f.contains_key("4-bit") && f.contains_key("8-bit") && f.contains_key("bf16"),
        "{f:?}"
    );
    // The hybrids: 2 full-attention layers of caches, 2 linear-attention layers of state
    // (4 * 16 * 16 state + (2 * 2 * 16 + 4 * 16) * 3 conv values, f32).
    let (next, three_five) = (inspect("qwen3_next"), inspect("qwen3_5_moe"));
    assert_eq!(next["kv_cache_bytes"], 2 * 2 * 2 * 64 * 16 * 2);
    assert_eq!(next["recurrent_state_bytes"], 2 * (4 * 16 * 16 + 128 * 3) * 4);
    assert_eq!(
        next["parameters"], three_five["parameters"],
        "the same sizes (Qwen3.5's separate projections hold as many values); no vision tower"
    );
    // The graph's persistent buffers are the caches and states counted above.
    let sum = |v: &serde_json::Value| {
        v["kv_cache_bytes"].as_u64().unwrap() + v["recurrent_state_bytes"].as_u64().unwrap()
    };
    assert_eq!(next["cache_and_state_bytes"].as_u64().unwrap(), sum(&next));
}

#[test]
fn quantised_on_load_weighs_what_the_quantised_checkpoint_does() {
    let q4 = ["--quant", "q4", "--group-size", "32"];
    let (dense, on_load, mlx) = (
        inspect("qwen3_moe"),
        inspect_with("qwen3_moe", &q4),
        inspect("qwen3_moe_mlx_q4"),
    );
    assert_eq!(on_load["loaded_weight_bytes"], mlx["loaded_weight_bytes"]);
    assert!(on_load["loaded_weight_bytes"].as_u64() < dense["loaded_weight_bytes"].as_u64());
    // Activations: a prefill chunk needs more than a decode step.
    assert!(dense["prefill_activation_bytes"].as_u64() > dense["decode_activation_bytes"].as_u64());
}

#[test]
fn a_gpu_budget_gives_a_placement_or_names_the_minimum() {
    // Roomy: every expert resident, nothing streams.
    let v = inspect_with("qwen3_moe", &["--gpu-mem", "1GiB"]);
    let p = &v["placement"];
    assert_eq!(p["streams"], false);
    assert_eq!(p["gpu_experts"], 16, "two MoE layers of 8 experts");
    // At the minimum: in each layer's cache the 2 experts a token takes, a layer's 8 experts
    // of staging; every layer's experts in host memory.
    let min = p["min_gpu_bytes"].as_u64().unwrap();
    let v = inspect_with("qwen3_moe", &["--gpu-mem", &min.to_string()]);
    let p = &v["placement"];
    assert_eq!(
        (
            p["streams"].as_bool(),
            p["gpu_experts"].as_u64(),
            p["slots_per_layer"].as_u64()
        ),
        (Some(true), Some(4), Some(2))
    );
    assert_eq!(
        (p["host_experts"].as_u64(), p["disk_experts"].as_u64()),
        (Some(16), Some(0))
    );
    // Below it: an error with the minimum.
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity/qwen3_moe");
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["inspect", "-m", dir.to_str().unwrap(), "--ctx", "64"])
        .args(["--gpu-mem", &(min - 1).to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains(&format!("({min} bytes)")),
        "{err}"
    );
}

#[test]
fn a_gguf_file_counts_as_its_directory() {
    let gguf = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    for (name, ty) in [("qwen3_moe_all", "bf16"), ("qwen3_next", "q8_0")] {
        let file = gguf.join(format!("{name}-{ty}.gguf"));
        let (g, d) = (inspect_path(&file, &[], &[]), inspect(name));
        for key in [
            "architecture",
            "layers",
            "moe_layers",
            "parameters",
            "active_parameters_per_token",
            "kv_cache_bytes",
        ] {
            assert_eq!(g[key], d[key], "{name}-{ty}: {key}");
        }
        assert_eq!(
            g["weight_bytes"],
            std::fs::metadata(&file).unwrap().len(),
            "{name}-{ty}"
        );
    }
}

#[test]
fn the_cuda_backends_projection_copies_are_counted() {
    // qwen3_moe quantised on load to 4 bits in groups of 64: per layer q, k, v, o (64 + 32 + 32 +
    // 64 rows of 64), the dense layer's gate and up (96 rows of 64; down's rows of 96 stay
    // bf16), the lm_head (256 rows of 64), as bf16; not the routers (their logits are exact) nor
    // the experts.
    let q4 = ["--quant", "q4", "--group-size", "64"];
    let v = inspect_with("qwen3_moe", &q4);
    assert_eq!(
        v["projection_copy_bytes"],
        2 * (3 * 192 * 64 + 2 * 96 * 64 + 256 * 64)
    );
    // Nothing quantised, nothing to copy.
    assert_eq!(inspect("qwen3_moe")["projection_copy_bytes"], 0);
    // Switched off.
    let off = inspect_env("qwen3_moe", &q4, &[("KESTREL_PROJECTION_COPIES", "off")]);
    assert_eq!(off["projection_copy_bytes"], 0);
}
