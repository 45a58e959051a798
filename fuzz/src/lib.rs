//! What the fuzz targets share: the fixed conversation chat templates are rendered with, the
//! smaller render bounds that keep a fuzzing run fast, and the count of renders a bound stopped
//! (each leaves its sandbox thread parked for good, holding up to the memory budget).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use kestrel_text::{ChatInput, ChatTemplate, RenderLimits, TextError};
use serde_json::{json, Value};

/// The bounds of a fuzzed render, far below the defaults (50 million instructions, 16 MiB of
/// output, 64 MiB, 10 s): one input costs at most a second or two, and a thread parked by a
/// stopped render holds little. The memory bound also caps how deep a template can nest a value
/// (about 3,000 lists in 256 KiB), far within what the sandbox thread's stack (at least 8 MiB)
/// holds of minijinja's recursion over it (dropping or printing it) even under ASan, whose
/// frames are several times larger (see the README). The published templates render the fixed
/// conversation within an eighth of each bound.
pub const LIMITS: RenderLimits = RenderLimits {
    fuel: 1_000_000,
    output: 1 << 20,
    memory: 256 << 10,
    time: Duration::from_secs(2),
};

/// The conversation every fuzzed template renders: system, user, an assistant turn with a tool
/// call, the tool's result and a second user turn, with one tool described.
pub struct Conversation {
    pub messages: Vec<Value>,
    pub tools: Vec<Value>,
}

impl Conversation {
    pub fn new() -> Conversation {
        let messages = vec![
            json!({"role": "system", "content": "You are terse. Use tools when they help."}),
            json!({"role": "user", "content": "Weather in Zürich, and is 2+2 still 4?"}),
            json!({
                "role": "assistant",
                "content": "<think>\nLook it up.\n</think>\n\nLet me check.",
                "reasoning_content": "Look it up.",
                "tool_calls": [{
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 1}}
                }]
            }),
            json!({"role": "tool", "tool_call_id": "call_0", "name": "get_weather",
                   "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"}),
            json!({"role": "user", "content": "Thanks. And tomorrow?"}),
        ];
        let tools = vec![json!({
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather at a place, in °C.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "description": "City name, e.g. Zürich"},
                        "days": {"type": ["integer", "null"], "enum": [1, 2, 3]}
                    },
                    "required": ["city"]
                }
            }
        })];
        Conversation { messages, tools }
    }

    /// The render input: the conversation, its tools, a generation prompt and the special tokens.
    pub fn input<'a>(&'a self, bos: Option<&'a str>, eos: Option<&'a str>) -> ChatInput<'a> {
        ChatInput {
            messages: &self.messages,
            tools: Some(&self.tools),
            add_generation_prompt: true,
            bos_token: bos,
            eos_token: eos,
            extra: serde_json::Map::from_iter([("enable_thinking".to_string(), json!(false))]),
        }
    }
}

impl Default for Conversation {
    fn default() -> Conversation {
        Conversation::new()
    }
}

/// Compiles `source` within the fuzzing bounds and, when it compiles, renders the fixed
/// conversation with it (`bos` and `eos` as the special tokens' text; see [`render`]).
pub fn compile_and_render(
    source: &str,
    bos: Option<&str>,
    eos: Option<&str>,
) -> Option<Result<String, TextError>> {
    static CONVERSATION: OnceLock<Conversation> = OnceLock::new();
    let template = ChatTemplate::with_limits(source, LIMITS).ok()?;
    let conversation = CONVERSATION.get_or_init(Conversation::new);
    Some(render(&template, &conversation.input(bos, eos)))
}

/// Renders stopped by the memory or time bound in this process so far.
static STOPPED: AtomicUsize = AtomicUsize::new(0);

/// Renders `template` with `input`. A render stopped by the memory or time bound is counted,
/// and the count is printed at each power of two, with the most the parked threads can hold:
/// a long run's growing memory is then explained in its log (libFuzzer's `-rss_limit_mb` ends a
/// run whose parked threads pass it; see the README).
pub fn render(template: &ChatTemplate, input: &ChatInput) -> Result<String, TextError> {
    let rendered = template.render(input);
    if let Err(TextError::Template(message)) = &rendered {
        if message.starts_with("rendering needed more than") || message.starts_with("rendering took longer") {
            let n = STOPPED.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                eprintln!(
                    "kestrel-fuzz: {n} renders stopped by a bound so far; their parked threads \
                     hold at most {} KiB of heap",
                    n * (LIMITS.memory >> 10)
                );
            }
        }
    }
    rendered
}

#[cfg(test)]
mod tests {
    //! The fuzzing bounds leave the published templates room: each renders the fixed conversation
    //! within an eighth of every bound, so a fuzzed input that passes one is far from them.

    use super::*;

    #[global_allocator]
    static ALLOC: kestrel_text::BoundedAlloc = kestrel_text::BoundedAlloc::new();

    #[test]
    fn published_templates_render_within_an_eighth_of_the_bounds() {
        let eighth = RenderLimits {
            fuel: LIMITS.fuel / 8,
            output: LIMITS.output / 8,
            memory: LIMITS.memory / 8,
            time: LIMITS.time / 8,
        };
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../crates/kestrel-text/tests/templates"
        );
        let conversation = Conversation::new();
        let mut rendered = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "jinja") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            let template = ChatTemplate::with_limits(&source, eighth).unwrap();
            let text = template
                .render(&conversation.input(Some("<s>"), Some("</s>")))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(text.contains("get_weather"), "{}: {text}", path.display());
            rendered += 1;
        }
        assert!(rendered >= 5, "{rendered} templates in {dir}");
    }
}
