//! `kestrel logits` end to end on the CPU backend: the file it writes holds the fixture's
//! reference logits (transformers, fp32) within 1e-3 of the largest, in prefill and decode mode;
//! bad input is an error that names its cause.

use std::path::PathBuf;
use std::process::Command;

use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn reference(name: &str) -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(fixture(name).join("reference/reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tokens = st
        .tensor("tokens")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    (tokens, f32s(st.tensor("logits").unwrap().data()))
}

fn kestrel(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn logits_match_the_reference_in_both_modes() {
    let (tokens, want) = reference("qwen3_moe");
    let ids = tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    let model = fixture("qwen3_moe");
    for mode in ["prefill", "decode"] {
        let out = std::env::temp_dir().join(format!(
            "kestrel-logits-{mode}-{}.safetensors",
            std::process::id()
        ));
        let o = kestrel(&[
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            &ids,
            "--backend",
            "cpu",
            "--mode",
            mode,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(
            o.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let bytes = std::fs::read(&out).unwrap();
        std::fs::remove_file(&out).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("logits").unwrap();
        assert_eq!(t.shape(), &[tokens.len(), 256]);
        let got = f32s(t.data());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        assert!(err <= 1e-3, "{mode}: error {err:e}");
    }
}

#[test]
fn bad_input_is_an_error_naming_the_cause() {
    let model = fixture("llama");
    let m = model.to_str().unwrap();
    let out = std::env::temp_dir().join("kestrel-logits-never-written.safetensors");
    let o_ = out.to_str().unwrap();
    let o = kestrel(&[
        "logits",
        "--model",
        m,
        "--tokens",
        "1,999",
        "--backend",
        "cpu",
        "--out",
        o_,
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("999"));
    let o = kestrel(&[
        "logits",
        "--model",
        "/nonexistent/model",
        "--tokens",
        "1",
        "--backend",
        "cpu",
        "--out",
        o_,
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("/nonexistent/model does not exist"), "{err}");
    let o = kestrel(&[
        "logits",
        "--model",
        m,
        "--tokens",
        "1,2,3",
        "--ctx",
        "2",
        "--backend",
        "cpu",
        "--out",
        o_,
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("context of 2"));
    assert!(!out.exists(), "nothing is written on error");
}

#[test]
fn quantising_on_load_gives_the_mlx_fixtures_logits() {
    // The bf16 qwen3_moe quantised on load to 4 bits in groups of 32 is the MLX fixture.
    let (tokens, want) = reference("qwen3_moe_mlx_q4");
    let ids = tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    let model = fixture("qwen3_moe");
    let out = std::env::temp_dir().join(format!("kestrel-logits-q4-{}.safetensors", std::process::id()));
    let o = kestrel(&[
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        &ids,
        "--backend",
        "cpu",
        "--quant",
        "q4",
        "--group-size",
        "32",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let got = f32s(st.tensor("logits").unwrap().data());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
    assert!(err <= 1e-3, "error {err:e}");
}
