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

/// Runs `kestrel run --json`: the JSON object of its last stdout line, and its stderr.
fn run_json(args: &[&str]) -> (serde_json::Value, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .arg("run")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{stderr}");
    let stdout = String::from_utf8(o.stdout).unwrap();
    let last = stdout.lines().last().expect("a JSON line");
    (serde_json::from_str(last).unwrap(), stderr)
}

/// Runs `kestrel run --json` and returns the generated ids.
fn run(args: &[&str]) -> Vec<u64> {
    run_json(args).0["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The fixture's prompt and transformers' greedy continuation of it.
fn greedy_reference(name: &str) -> (Vec<String>, Vec<u64>) {
    let greedy: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference/greedy.json")).unwrap())
            .unwrap();
    let prompt = greedy["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect();
    let want = greedy["continuation"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (prompt, want)
}

/// `run -m FILE.gguf` reads everything from the file: the float conversions of the fixtures by
/// llama.cpp's converter continue as transformers does, and a text prompt goes through the
/// file's own tokenizer (the fixtures' is byte-level over their 256 tokens: token i is byte i).
#[test]
fn gguf_files_generate_as_their_directories() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    for (name, ty) in [
        ("llama", "f16"),
        ("qwen3", "bf16"),
        ("qwen3_next", "f16"),
        ("qwen3_5_moe", "f16"),
    ] {
        let (prompt, want) = greedy_reference(name);
        let file = dir.join(format!("{name}-{ty}.gguf"));
        let file = file.to_str().unwrap();
        let args = [
            "-m",
            file,
            "-n",
            "24",
            "--temperature",
            "0",
            "--backend",
            "cpu",
            "--json",
        ];
        let got = run(&[&args[..], &["--prompt-tokens", &prompt.join(",")]].concat());
        assert_eq!(got, want, "{name}-{ty}");
    }
    let file = dir.join("llama-q8_0.gguf");
    let file = file.to_str().unwrap();
    let cpu = ["--backend", "cpu", "--json"];
    let (v, _) = run_json(&[&["-m", file, "-p", "Grüße", "--raw", "-n", "3"][..], &cpu].concat());
    assert_eq!(v["prompt_tokens"], "Grüße".len(), "{v}");
    assert_eq!(v["tokens"].as_array().unwrap().len(), 3, "{v}");
    // The chat template from the file's metadata (a split model's first file carries it).
    let file = dir.join("split/qwen3_next-q8_0-00002-of-00003.gguf");
    let file = file.to_str().unwrap();
    let (v, _) = run_json(&[&["-m", file, "-p", "hi", "-n", "1"][..], &cpu].concat());
    assert_eq!(v["prompt_tokens"], "<|user|>hi\n<|assistant|>".len(), "{v}");
}

/// A GGUF model whose experts do not fit streams them (from host memory, and from the file on
/// disk past the host budget) and generates what it generates resident.
#[test]
fn gguf_experts_stream_as_a_directorys_do() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let file = dir.join("qwen3_moe_all-bf16.gguf");
    let file = file.to_str().unwrap();
    let args = [
        "-m",
        file,
        "--prompt-tokens",
        "1,17,42,99,3",
        "-n",
        "8",
        "--temperature",
        "0",
    ];
    let run_with = |budget: &[&str]| {
        let (v, stderr) = run_json(&[&args[..], &["--backend", "cpu", "--json"], budget].concat());
        (v["tokens"].clone(), stderr)
    };
    let (resident, _) = run_with(&[]);
    let (tokens, said) = run_with(&["--gpu-mem", "276KiB"]);
    assert!(said.contains("host memory (16 experts)"), "{said}");
    assert_eq!(tokens, resident);
    let (tokens, said) = run_with(&["--gpu-mem", "276KiB", "--host-mem", "1KiB"]);
    assert!(said.contains("checkpoint on disk (16)"), "{said}");
    assert_eq!(tokens, resident);
}

#[test]
fn greedy_generation_matches_transformers_for_every_fixture() {
    for name in FIXTURES {
        let (prompt, want) = greedy_reference(name);
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
