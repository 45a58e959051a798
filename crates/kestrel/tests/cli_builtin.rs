//! `kestrel run` on the built-in model (`models/kestrel-tiny`) the way the README's first
//! command runs it on a fresh clone: no `-m`, on the CPU. The answer is text and `--json`
//! parses; greedy decoding of the chat-templated question gives exactly the ids transformers
//! gave when the training script saved the model (`transformers-greedy.json`).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn builtin() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/kestrel-tiny")
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
