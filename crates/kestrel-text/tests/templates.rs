//! Chat templates rendered by Kestrel equal what transformers renders, for the published Qwen3
//! and Llama 3.2 templates in `tests/templates/` (system prompts, thinking on and off, reasoning in
//! earlier turns, tools with non-ASCII schemas, tool calls and results, `tojson(indent=4)`,
//! `raise_exception`); and the sandbox limits hold.

use std::path::PathBuf;

use kestrel_text::{ChatInput, ChatTemplate};
use serde_json::Value;

fn dir() -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-text/tests/templates")
}

#[test]
fn renders_as_transformers_does() {
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let source = std::fs::read_to_string(dir().join(case["template"].as_str().unwrap())).unwrap();
        let template = ChatTemplate::new(&source).unwrap();
        let mut extra = case["kwargs"].as_object().unwrap().clone();
        let add_generation_prompt = extra
            .remove("add_generation_prompt")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let messages = case["messages"].as_array().unwrap();
        let tools = case["tools"].as_array();
        let input = ChatInput {
            messages,
            tools: tools.map(|t| t.as_slice()),
            add_generation_prompt,
            bos_token: None,
            eos_token: None,
            extra,
        };
        let got = template.render(&input);
        match (&case["expected"], &case["error"]) {
            (Value::String(want), _) => assert_eq!(&got.unwrap(), want, "{name}"),
            (_, Value::String(want)) => {
                let err = got
                    .err()
                    .unwrap_or_else(|| panic!("{name}: rendered, should raise"))
                    .to_string();
                assert!(err.contains(want.as_str()), "{name}: {err}");
            }
            _ => panic!("{name}: no expectation"),
        }
    }
}

#[test]
fn runaway_templates_stop() {
    let messages = [serde_json::json!({"role": "user", "content": "x"})];
    let input = ChatInput {
        messages: &messages,
        ..Default::default()
    };
    // Too much work: the fuel runs out.
    let spin =
        ChatTemplate::new("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
            .unwrap();
    let err = spin.render(&input).err().unwrap().to_string();
    assert!(err.contains("fuel"), "{err}");
    // Too much output.
    let big = ChatTemplate::new("{% for i in range(20000) %}{{ 'x' * 1000 }}{% endfor %}").unwrap();
    let err = big.render(&input).err().unwrap().to_string();
    assert!(err.contains("bytes"), "{err}");
    // A syntax error names the template's fault.
    assert!(ChatTemplate::new("{% if %}").is_err());
}
