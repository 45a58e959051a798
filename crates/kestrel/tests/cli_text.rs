//! `kestrel run` with text, on the CPU: a copy of the qwen3 fixture whose vocabulary is widened
//! to the test tokenizer's (random embedding and output rows) and which carries that tokenizer.
//! The streamed text equals the JSON's, which is the decode of the generated ids; the chat
//! template wraps the prompt unless `--raw`; a stop string ends generation and is not printed;
//! an end-of-sequence id from `generation_config.json` ends it too.

mod common;

use std::path::Path;
use std::process::Command;

use common::model_dir;
use kestrel_text::Tokenizer;
use serde_json::Value;

fn kestrel(dir: &Path, args: &[&str]) -> (String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["run", "-m", dir.to_str().unwrap(), "--backend", "cpu"])
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

fn json(dir: &Path, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let (out, _) = kestrel(dir, &all);
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

#[test]
fn text_in_text_out() {
    let d = model_dir("plain", None);
    let tok = Tokenizer::from_dir(&d.0).unwrap().unwrap();
    let base = ["-p", "Return the number of items", "-n", "12", "--temp", "0"];
    let v = json(&d.0, &base);
    let ids: Vec<u32> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids.len(), 12, "no EOS configured: all 12 tokens");
    let text = v["text"].as_str().unwrap().to_string();
    assert_eq!(text, tok.decode(&ids, true).unwrap());
    // Streamed: the same text on stdout, the figures on stderr.
    let (out, err) = kestrel(&d.0, &base);
    assert_eq!(out, format!("{text}\n"));
    assert!(
        err.contains("load:") && err.contains("prompt:") && err.contains("tokens/s"),
        "{err}"
    );
    // Not a terminal: loading reports plain lines, the last at 100%.
    assert!(err.contains("loading ") && err.contains(": 100% ("), "{err}");
    // The chat template wraps the prompt; --raw does not.
    let raw = json(&d.0, &[&base[..], &["--raw"]].concat());
    assert!(
        raw["prompt_tokens"].as_u64() < v["prompt_tokens"].as_u64(),
        "{raw} vs {v}"
    );
    // A stop string: text up to it, not printed, and generation ends.
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 4 {
        let stop: String = chars[2..4].iter().collect();
        let at = text.find(&stop).unwrap();
        let s = json(&d.0, &[&base[..], &["--stop", &stop]].concat());
        assert_eq!(s["text"].as_str().unwrap(), &text[..at]);
        assert_eq!(s["stop_reason"], "stop");
    }
    // An end-of-sequence id ends generation before it.
    let cut = ids[4];
    let first = ids.iter().position(|&t| t == cut).unwrap();
    let e = model_dir("eos", Some(cut));
    let v = json(&e.0, &base);
    assert_eq!(v["stop_reason"], "eos");
    let got: Vec<u32> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(got, ids[..first]);
    let v = json(&e.0, &[&base[..], &["--ignore-eos"]].concat());
    assert_eq!(v["tokens"].as_array().unwrap().len(), 12);
}

#[test]
fn sampled_text_is_reproducible() {
    let d = model_dir("sampled", None);
    let args = [
        "-p",
        "def f(x):",
        "-n",
        "10",
        "--temp",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        "--seed",
        "5",
    ];
    let (a, b) = (json(&d.0, &args), json(&d.0, &args));
    assert_eq!(a["tokens"], b["tokens"]);
    let mut other = args.to_vec();
    let last = other.len() - 1;
    other[last] = "6";
    assert_ne!(json(&d.0, &other)["tokens"], a["tokens"]);
}

/// The model's `chat_template.jinja` wins over tokenizer_config.json's; `--no-think` and
/// `--chat-template-kwargs` reach it (Qwen3's template closes an empty think block).
#[test]
fn template_variables() {
    let d = model_dir("think", None);
    let qwen3 = common::root().join("kestrel-text/tests/templates/Qwen-Qwen3-0.6B.jinja");
    std::fs::copy(qwen3, d.0.join("chat_template.jinja")).unwrap();
    let base = ["-p", "2+2?", "-n", "2", "--temp", "0"];
    let count = |extra: &[&str]| {
        json(&d.0, &[&base[..], extra].concat())["prompt_tokens"]
            .as_u64()
            .unwrap()
    };
    let plain = count(&[]);
    let no_think = count(&["--no-think"]);
    assert!(no_think > plain, "{no_think} vs {plain}");
    assert_eq!(
        count(&["--chat-template-kwargs", r#"{"enable_thinking": false}"#]),
        no_think
    );
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "run",
            "-m",
            d.0.to_str().unwrap(),
            "--backend",
            "cpu",
            "-p",
            "x",
            "--chat-template-kwargs",
            "[1]",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("not a JSON object"), "{err}");
}
