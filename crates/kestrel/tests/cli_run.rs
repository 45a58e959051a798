//! `kestrel run` end to end on the CPU backend: with temperature 0 it generates exactly the
//! 24-token greedy continuation transformers produced for every fixture; sampling is
//! reproducible from its seed; bad arguments are errors.

use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name)
}

const FIXTURES: [&str; 6] = [
    "llama",
    "qwen3",
    "qwen3_moe",
    "qwen3_moe_mlx_q4",
    "qwen3_next",
    "qwen3_5_moe",
];

/// Runs `kestrel run --json` and returns the generated ids from its last stdout line.
fn run(args: &[&str]) -> Vec<u64> {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .arg("run")
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8(o.stdout).unwrap();
    let last = stdout.lines().last().expect("a JSON line");
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn greedy_generation_matches_transformers_for_every_fixture() {
    for name in FIXTURES {
        let greedy: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("reference/greedy.json")).unwrap(),
        )
        .unwrap();
        let prompt: Vec<String> = greedy["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect();
        let want: Vec<u64> = greedy["continuation"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        let model = fixture(name);
        let got = run(&[
            "--model",
            model.to_str().unwrap(),
            "--prompt-tokens",
            &prompt.join(","),
            "-n",
            "24",
            "--temperature",
            "0",
            "--backend",
            "cpu",
            "--json",
        ]);
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn sampling_is_reproducible_from_the_seed() {
    let model = fixture("llama");
    let args = |seed: &'static str| {
        vec![
            "--model".to_string(),
            model.to_str().unwrap().to_string(),
            "--prompt-tokens".into(),
            "1,2,3".into(),
            "-n".into(),
            "16".into(),
            "--temperature".into(),
            "1.5".into(),
            "--seed".into(),
            seed.into(),
            "--backend".into(),
            "cpu".into(),
            "--json".into(),
        ]
    };
    let r = |seed| {
        let a = args(seed);
        run(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (a, b, c) = (r("7"), r("7"), r("8"));
    assert_eq!(a.len(), 16);
    assert_eq!(a, b, "the same seed draws the same tokens");
    assert_ne!(a, c, "another seed draws others (16 tokens at temperature 1.5)");
}

#[test]
fn bad_arguments_are_errors() {
    let model = fixture("llama");
    let m = model.to_str().unwrap();
    for extra in [vec!["--temperature=-1"], vec!["--ctx", "3"]] {
        let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .args([
                "run",
                "--model",
                m,
                "--prompt-tokens",
                "1,2",
                "-n",
                "4",
                "--backend",
                "cpu",
            ])
            .args(&extra)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("temperature") || err.contains("context of 3"),
            "{err}"
        );
    }
}
