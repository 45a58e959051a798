//! `kestrel run` on the built-in model (`models/kestrel-tiny`) the way the README's first
//! command runs it on a fresh clone: no `-m`, on the CPU. The answer is text and `--json`
//! parses; greedy decoding of the chat-templated question gives exactly the ids transformers
//! gave when the training script saved the model (`transformers-greedy.json`).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn builtin() -> PathBuf {
    kestrel_testing::fixtures::path("models/kestrel-tiny")
}

/// `kestrel run` with `args` on the CPU: (stdout, stderr), after checking it succeeded.
fn run(args: &[&str]) -> (String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["run", "--backend", "cpu"])
        .args(args)
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8(o.stdout).unwrap(),
        String::from_utf8(o.stderr).unwrap(),
    );
    assert!(o.status.success(), "{args:?}: {err}");
    (out, err)
}

#[test]
fn the_readme_command_prints_text() {
    let (out, err) = run(&["-p", "What does json.dumps do?", "-n", "24", "--seed", "7"]);
    assert!(
        out.trim().chars().filter(|c| c.is_alphabetic()).count() >= 8,
        "no text on stdout: {out:?}"
    );
    assert!(err.contains("generated:"), "no speed line on stderr: {err}");
    assert!(
        err.contains("kestrel-tiny"),
        "the built-in model was not named: {err}"
    );
}

#[test]
fn greedy_answers_match_transformers() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(builtin().join("transformers-greedy.json")).unwrap())
            .unwrap();
    let eos: Vec<u64> = {
        let g: Value =
            serde_json::from_str(&std::fs::read_to_string(builtin().join("generation_config.json")).unwrap())
                .unwrap();
        g["eos_token_id"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    let cases = reference.as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        let question = case["prompt"].as_str().unwrap();
        let mut want: Vec<u64> = case["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let max_new = want.len();
        let ended = want.last().is_some_and(|t| eos.contains(t));
        if ended {
            want.pop();
        }
        let n = max_new.to_string();
        let (out, _) = run(&["-p", question, "-n", &n, "--temp", "0", "--json"]);
        let v: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        let prompt_len = case["prompt_ids"].as_array().unwrap().len() as u64;
        assert_eq!(
            v["prompt_tokens"].as_u64(),
            Some(prompt_len),
            "{question}: the templated prompt"
        );
        let got: Vec<u64> = v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        assert_eq!(got, want, "{question}: {}", v["text"]);
        let stop = if ended { "eos" } else { "length" };
        assert_eq!(v["stop_reason"].as_str(), Some(stop), "{question}");
        assert!(!v["text"].as_str().unwrap().is_empty());
    }
}

/// A copy of the binary in a folder of its own, started from another directory with an empty
/// environment, runs the README's main command: the built-in model comes from the binary, and
/// no path into the checkout's `models/` folder is compiled into it (so deleting the checkout
/// cannot break it; `scripts/check-copied-binary.sh` does exactly that with a fresh clone).
#[test]
fn a_copied_binary_runs_from_anywhere() {
    let tmp = std::env::temp_dir().join(format!("kestrel-copied-{}", std::process::id()));
    let (bin, work) = (tmp.join("bin"), tmp.join("work"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let copy = bin.join("kestrel");
    std::fs::copy(env!("CARGO_BIN_EXE_kestrel"), &copy).unwrap();
    let o = Command::new(&copy)
        .env_clear()
        .env("HOME", &work)
        .current_dir(&work)
        .args([
            "run",
            "--backend",
            "cpu",
            "-p",
            "What does os.path.join do?",
            "-n",
            "24",
        ])
        .args(["--seed", "1"])
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{err}");
    assert!(out.chars().filter(|c| c.is_alphabetic()).count() >= 8, "{out:?}");
    // The folder as a path relative to this crate would be compiled in, and as it resolves.
    let relative = format!("{}/../../models", env!("CARGO_MANIFEST_DIR"));
    let resolved = std::path::Path::new(&relative).canonicalize().unwrap();
    let bytes = std::fs::read(&copy).unwrap();
    for needle in [relative, resolved.to_string_lossy().into_owned()] {
        assert!(
            !bytes.windows(needle.len()).any(|w| w == needle.as_bytes()),
            "the binary holds the path {needle}"
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// With a memory budget too small for every expert, `run` says it streams them and generates
/// exactly the tokens of the resident run (CPU, greedy): the smallest budget `inspect` names,
/// a token's experts in each layer's cache beside the rest, so experts are evicted every token.
#[test]
fn streamed_experts_generate_the_resident_tokens() {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        // As the CPU run holds it: f32 caches, the whole context as one prefill chunk.
        .args([
            "inspect",
            "--ctx",
            "64",
            "--cache",
            "f32",
            "--prefill-chunk",
            "64",
        ])
        .args(["--gpu-mem", "1TiB", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let min = v["placement"]["min_gpu_bytes"].as_u64().unwrap().to_string();
    let question = [
        "-p",
        "What does os.path.join do?",
        "-n",
        "20",
        "--temp",
        "0",
        "-c",
        "64",
    ];
    let (resident, _) = run(&[&question[..], &["--json"]].concat());
    let (streamed, err) = run(&[&question[..], &["--json", "--gpu-mem", &min]].concat());
    assert!(err.contains("streaming experts"), "{err}");
    let tokens = |out: &str| -> Value {
        let v: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        v["tokens"].clone()
    };
    assert_eq!(tokens(&streamed), tokens(&resident));
}
