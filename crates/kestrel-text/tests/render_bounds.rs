//! With `BoundedAlloc` as the global allocator (as the `kestrel` binary has it), templates that
//! grow a value without bound (a string, list or namespace value doubled forty times, a huge
//! `indent` or repeated string) or run too long stop with an error within seconds instead of
//! aborting the process, the stopped template renders again with a fresh environment (until
//! `MAX_ABANDONED` stops, then it refuses), and other templates go on rendering in the same
//! process; running out of fuel leaves the template usable; a deeply nested
//! value does not overflow the render's stack; a real 50-turn conversation stays far below the
//! bounds.

use std::time::{Duration, Instant};

use kestrel_text::{BoundedAlloc, ChatInput, ChatTemplate, RenderLimits, MAX_ABANDONED};
use serde_json::json;

#[global_allocator]
static ALLOC: BoundedAlloc = BoundedAlloc::new();

/// `{% set_line %}` forty times after `setup`, then `tail`.
fn doubling(setup: &str, set_line: &str, tail: &str) -> String {
    format!("{setup}{}{tail}", set_line.repeat(40))
}

/// Renders `source` within `limits`, expects an error containing `want`, and checks that the
/// template's next render runs (and is stopped the same way) and that a normal template still
/// renders.
fn assert_stops(source: &str, limits: RenderLimits, want: &str) -> Duration {
    let messages = [json!({"role": "user", "content": "Hi"})];
    let input = ChatInput {
        messages: &messages,
        ..Default::default()
    };
    let template = ChatTemplate::with_limits(source, limits).unwrap();
    let start = Instant::now();
    let err = template
        .render(&input)
        .err()
        .unwrap_or_else(|| panic!("{source}: rendered"))
        .to_string();
    let took = start.elapsed();
    assert!(err.contains(want), "{source}: {err}");
    eprintln!("{want:?} after {took:?}");
    let again = template.render(&input).err().unwrap().to_string();
    assert!(again.contains(want), "{again}");
    let normal =
        ChatTemplate::new("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}").unwrap();
    assert_eq!(normal.render(&input).unwrap(), "[user] Hi");
    took
}

const MEMORY: &str = "rendering needed more than 64 MiB of memory";

#[test]
fn the_allocator_is_installed() {
    assert!(BoundedAlloc::is_installed());
}

#[test]
fn namespace_doubling_stops_at_the_memory_bound() {
    let source = doubling(
        "{% set ns = namespace(l=\"ab\") %}",
        "{% set ns.l = ns.l + ns.l %}",
        "{{ ns.l|length }}",
    );
    assert_stops(&source, RenderLimits::default(), MEMORY);
}

#[test]
fn top_level_concatenation_stops_at_the_memory_bound() {
    let source = doubling("{% set a = \"ab\" %}", "{% set a = a ~ a %}", "{{ a|length }}");
    assert_stops(&source, RenderLimits::default(), MEMORY);
}

#[test]
fn list_doubling_stops_at_the_memory_bound() {
    let source = doubling("{% set l = [1, 2] %}", "{% set l = l + l %}", "{{ l|length }}");
    assert_stops(&source, RenderLimits::default(), MEMORY);
}

#[test]
fn replace_in_a_loop_stops_at_the_memory_bound() {
    let source = "{% set ns = namespace(s=\"ab\") %}{% for i in range(40) %}\
                  {% set ns.s = ns.s.replace(\"a\", ns.s) %}{% endfor %}{{ ns.s|length }}";
    assert_stops(source, RenderLimits::default(), MEMORY);
}

#[test]
fn one_huge_value_stops_at_the_memory_bound() {
    // One allocation of a terabyte.
    assert_stops(
        "{{ \"a\\nb\"|indent(1000000000000) }}",
        RenderLimits::default(),
        MEMORY,
    );
    // Three strings of 100 MB each, which minijinja's own cap on `*` lets through one by one.
    let source = "{% set a = \"x\" * 100000000 %}{% set b = \"y\" * 100000000 %}\
                  {% set c = \"z\" * 100000000 %}{{ (a ~ b ~ c)|length }}";
    assert_stops(source, RenderLimits::default(), MEMORY);
}

#[test]
fn a_smaller_budget_is_named() {
    let limits = RenderLimits {
        memory: 8 << 20,
        ..RenderLimits::default()
    };
    let source = doubling("{% set a = \"ab\" %}", "{% set a = a ~ a %}", "{{ a|length }}");
    assert_stops(&source, limits, "rendering needed more than 8 MiB of memory");
}

#[test]
fn a_template_stopped_max_abandoned_times_refuses_to_render() {
    let limits = RenderLimits {
        memory: 4 << 20,
        ..RenderLimits::default()
    };
    let messages = [json!({"role": "user", "content": "Hi"})];
    let input = ChatInput {
        messages: &messages,
        ..Default::default()
    };
    let source = doubling("{% set a = \"ab\" %}", "{% set a = a ~ a %}", "{{ a|length }}");
    let template = ChatTemplate::with_limits(&source, limits).unwrap();
    for _ in 0..MAX_ABANDONED {
        let err = template.render(&input).err().unwrap().to_string();
        assert!(
            err.contains("rendering needed more than 4 MiB of memory"),
            "{err}"
        );
    }
    let err = template.render(&input).err().unwrap().to_string();
    assert!(
        err.contains(&format!(
            "{MAX_ABANDONED} earlier renders of this template were stopped"
        )),
        "{err}"
    );
    // A fork is a template of its own, with its own count.
    let fork = template.fork().unwrap();
    let err = fork.render(&input).err().unwrap().to_string();
    assert!(
        err.contains("rendering needed more than 4 MiB of memory"),
        "{err}"
    );
}

#[test]
fn a_slow_render_stops_at_the_time_bound() {
    let limits = RenderLimits {
        time: Duration::from_millis(500),
        ..RenderLimits::default()
    };
    // Each `upper` copies 20 MB: well within the memory bound, a few milliseconds each, and
    // 100,000 of them take far longer than the bound.
    let source = "{% set s = \"x\" * 20000000 %}{% for i in range(100000) %}{% set t = s.upper() %}\
                  {% endfor %}";
    let took = assert_stops(source, limits, "rendering took longer than 0.5 s");
    assert!(took >= limits.time && took < limits.time * 4, "{took:?}");
}

#[test]
fn a_deeply_nested_value_is_dropped_and_printed_without_overflowing_the_stack() {
    // Half a million levels of lists (about 43 MB, within the 64 MiB budget): dropping them
    // recurses half a million frames deep, past a standard thread stack (which overflows near
    // 40,000), and printing them deeper still; both within the sandbox's stack.
    let messages = [json!({"role": "user", "content": "x"})];
    let input = ChatInput {
        messages: &messages,
        ..Default::default()
    };
    let nest = "{% set ns = namespace(l=[]) %}{% for j in range(50) %}{% for i in range(10000) %}\
                {% set ns.l = [ns.l] %}{% endfor %}{% endfor %}";
    let t = ChatTemplate::new(&format!("{nest}{{{{ ns.l|length }}}}")).unwrap();
    assert_eq!(t.render(&input).unwrap(), "1");
    let t = ChatTemplate::new(&format!("{nest}{{{{ ('' ~ ns.l)|length }}}}")).unwrap();
    assert_eq!(t.render(&input).unwrap(), "1000002");
    // Deeper than the budget allows: the memory bound, not the stack, stops it.
    let deeper = ChatTemplate::new(
        "{% set ns = namespace(l=[]) %}{% for j in range(100) %}{% for i in range(10000) %}\
         {% set ns.l = [ns.l] %}{% endfor %}{% endfor %}{{ '' ~ ns.l }}",
    )
    .unwrap();
    let e = deeper.render(&input).unwrap_err().to_string();
    assert!(e.contains(MEMORY), "{e}");
}

#[test]
fn fuel_is_an_ordinary_error() {
    let messages = [json!({"role": "user", "content": "x"})];
    let input = ChatInput {
        messages: &messages,
        ..Default::default()
    };
    // Less fuel than the default (which takes seconds in a debug build) keeps the test quick.
    let limits = RenderLimits {
        fuel: 5_000_000,
        ..RenderLimits::default()
    };
    let spin = ChatTemplate::with_limits(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        limits,
    )
    .unwrap();
    let start = Instant::now();
    for _ in 0..2 {
        // The template stays usable: the second render runs out of fuel the same way.
        let err = spin.render(&input).err().unwrap().to_string();
        assert!(err.contains("fuel"), "{err}");
    }
    eprintln!("two renders out of fuel in {:?}", start.elapsed());
}

#[test]
fn real_templates_stay_far_below_the_bounds() {
    // A 50-turn Qwen3 conversation with tools and tool calls renders within a budget of 8 MiB.
    let source = std::fs::read_to_string(kestrel_testing::fixtures::path(
        "crates/kestrel-text/tests/templates/Qwen-Qwen3-0.6B.jinja",
    ))
    .unwrap();
    let limits = RenderLimits {
        memory: 8 << 20,
        fuel: 1_000_000,
        ..RenderLimits::default()
    };
    let template = ChatTemplate::with_limits(&source, limits).unwrap();
    let tool = json!({"type": "function", "function": {"name": "get_weather", "description": "Weather at a place.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    for turn in 0..50 {
        messages
            .push(json!({"role": "user", "content": format!("Question {turn}: {}", "words ".repeat(200))}));
        messages.push(json!({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]}));
        messages.push(json!({"role": "tool", "content": "{\"temp\": 21}"}));
        messages.push(json!({"role": "assistant", "content": format!("<think>\nturn {turn}\n</think>\n\nAnswer {turn}.")}));
    }
    let tools = [tool];
    let input = ChatInput {
        messages: &messages,
        tools: Some(&tools),
        add_generation_prompt: true,
        ..Default::default()
    };
    let start = Instant::now();
    let out = template.render(&input).unwrap();
    eprintln!("50 turns: {} bytes in {:?}", out.len(), start.elapsed());
    assert!(out.contains("Question 49") && out.ends_with("<|im_start|>assistant\n"));
}
