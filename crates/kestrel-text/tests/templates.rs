//! Chat templates rendered by Kestrel equal what transformers renders, for the published Qwen3,
//! Qwen3-Next, Qwen3.5, Qwen3-Coder and Llama 3.2 templates in `tests/templates/` (system prompts,
//! thinking on and off, reasoning in earlier turns, tools with non-ASCII schemas, tool calls and
//! results, macros, `loop.previtem`, `tojson(indent=4)`, `raise_exception`); macros and includes
//! work within the sandbox, with no access to files; and without `BoundedAlloc` installed (this
//! test binary does not install it) the fuel, output and time bounds still hold.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kestrel_text::{BoundedAlloc, ChatInput, ChatTemplate, RenderLimits};
use serde_json::Value;

fn dir() -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-text/tests/templates")
}

#[test]
fn renders_as_transformers_does() {
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap();
    let cases = cases["cases"].as_array().unwrap();
    // Every published template in the folder has cases.
    for entry in std::fs::read_dir(dir()).unwrap() {
        let file = entry.unwrap().file_name().into_string().unwrap();
        if file.ends_with(".jinja") {
            let n = cases.iter().filter(|c| c["template"] == file.as_str()).count();
            assert!(n >= 2, "{file} has {n} cases");
        }
    }
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

fn user_input(messages: &[Value]) -> ChatInput<'_> {
    ChatInput {
        messages,
        ..Default::default()
    }
}

#[test]
fn runaway_templates_stop_without_the_allocator() {
    assert!(!BoundedAlloc::is_installed());
    let messages = [serde_json::json!({"role": "user", "content": "x"})];
    let input = user_input(&messages);
    // Too much work: the fuel runs out (less fuel than the default keeps the test quick).
    let limits = RenderLimits {
        fuel: 5_000_000,
        ..RenderLimits::default()
    };
    let spin = ChatTemplate::with_limits(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        limits,
    )
    .unwrap();
    let err = spin.render(&input).err().unwrap().to_string();
    assert!(err.contains("fuel"), "{err}");
    // Too much output.
    let big = ChatTemplate::new("{% for i in range(20000) %}{{ 'x' * 1000 }}{% endfor %}").unwrap();
    let err = big.render(&input).err().unwrap().to_string();
    assert!(err.contains("passed 16777216 bytes"), "{err}");
    // Too slow: the caller has its answer at the deadline, though nothing stops the thread, which
    // finishes its 200 copies of 20 MB (a second or more) by itself.
    let limits = RenderLimits {
        time: Duration::from_millis(100),
        ..RenderLimits::default()
    };
    let slow = ChatTemplate::with_limits(
        "{% set s = 'x' * 20000000 %}{% for i in range(200) %}{% set t = s.upper() %}{% endfor %}",
        limits,
    )
    .unwrap();
    let start = Instant::now();
    let err = slow.render(&input).err().unwrap().to_string();
    assert!(err.contains("rendering took longer than 0.1 s"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    // A syntax error names the template's fault.
    assert!(ChatTemplate::new("{% if %}").is_err());
}

#[test]
fn macros_and_includes_stay_inside_the_template() {
    let messages = [serde_json::json!({"role": "user", "content": "x"})];
    let input = user_input(&messages);
    let render = |source: &str| ChatTemplate::new(source).and_then(|t| t.render(&input));
    assert_eq!(
        render("{% macro tag(name, body) %}<{{ name }}>{{ body }}</{{ name }}>{% endmacro %}{{ tag('b', 'hi') }}").unwrap(),
        "<b>hi</b>"
    );
    assert_eq!(
        render("{% for m in ['a', 'b'] %}{{ loop.previtem or '-' }}{{ m }}{{ loop.nextitem or '-' }} {% endfor %}").unwrap(),
        "-ab ab- "
    );
    // A macro calling itself without end stops at minijinja's recursion limit.
    let err = render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("recursion limit"), "{err}");
    // No loader: an include or import names a template that does not exist, and no file is read.
    for (source, name) in [
        ("{% include 'Cargo.toml' %}", "\"Cargo.toml\""),
        ("{% import '/etc/hostname' as m %}", "\"/etc/hostname\""),
        ("{% from 'macros.jinja' import tag %}", "\"macros.jinja\""),
        ("{% extends 'base.jinja' %}", "\"base.jinja\""),
    ] {
        let err = render(source).unwrap_err().to_string();
        assert!(
            err.contains("template not found") && err.contains(name),
            "{source}: {err}"
        );
    }
}
