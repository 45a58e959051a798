//! A chat answer's text split as the Qwen family writes it: the thinking section (`<think>` ...
//! `</think>`) becomes `reasoning_content`, tool calls (`<tool_call>` ... `</tool_call>`, a JSON
//! object `{"name", "arguments"}` or the XML form `<function=NAME><parameter=P>V</parameter>
//! </function>`) become `tool_calls`, and the rest is `content`. Text arrives in pieces as it is
//! generated; a piece that may be the start of a tag is held back until it is known not to be.

use serde_json::{Map, Value};

const THINK: &str = "<think>";
const THINK_END: &str = "</think>";
const CALL: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";

/// A part of the answer, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Reasoning(String),
    Content(String),
    /// A complete tool call: the function's name and its arguments as a JSON text.
    ToolCall {
        name: String,
        arguments: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Before anything: a `<think>` here opens the thinking section.
    Start,
    Reasoning,
    Content,
    /// Inside `<tool_call>`.
    Call,
}

/// Splits one answer's text as it comes.
#[derive(Debug)]
pub struct Splitter {
    mode: Mode,
    /// Whether to look for tool calls (the request gave tools).
    tools: bool,
    /// Text not yet given out: a possible tag's beginning, or a tool call's body.
    held: String,
    /// The whitespace after `</think>` is still to be dropped.
    strip: bool,
}

impl Splitter {
    /// `thinking`: the model writes a thinking section (its vocabulary has the tags);
    /// `opened`: the prompt already opened it (the template ends with `<think>`); `tools`:
    /// look for tool calls.
    pub fn new(thinking: bool, opened: bool, tools: bool) -> Splitter {
        let mode = match (thinking, opened) {
            (true, true) => Mode::Reasoning,
            (true, false) => Mode::Start,
            (false, _) => Mode::Content,
        };
        Splitter {
            mode,
            tools,
            held: String::new(),
            strip: false,
        }
    }

    /// The parts `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.held.push_str(text);
        let mut parts = Vec::new();
        loop {
            match self.mode {
                Mode::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK) {
                        self.held = rest.to_string();
                        self.mode = Mode::Reasoning;
                    } else if t.is_empty() || THINK.starts_with(t) {
                        return parts;
                    } else {
                        self.mode = Mode::Content;
                    }
                }
                Mode::Reasoning => match self.held.find(THINK_END) {
                    Some(at) => {
                        let before = self.held[..at].to_string();
                        self.held.drain(..at + THINK_END.len());
                        add(&mut parts, Part::Reasoning(before));
                        self.mode = Mode::Content;
                        self.strip = true;
                    }
                    None => {
                        let keep = partial_tag(&self.held, &[THINK_END]);
                        let out = self.held[..self.held.len() - keep].to_string();
                        self.held.drain(..self.held.len() - keep);
                        add(&mut parts, Part::Reasoning(out));
                        return parts;
                    }
                },
                Mode::Content => {
                    if self.strip {
                        let ws = self.held.len() - self.held.trim_start().len();
                        self.held.drain(..ws);
                        if self.held.is_empty() {
                            return parts;
                        }
                        self.strip = false;
                    }
                    let found = if self.tools { self.held.find(CALL) } else { None };
                    match found {
                        Some(at) => {
                            let before = self.held[..at].to_string();
                            self.held.drain(..at + CALL.len());
                            add(&mut parts, Part::Content(before));
                            self.mode = Mode::Call;
                        }
                        None => {
                            let keep = if self.tools {
                                partial_tag(&self.held, &[CALL])
                            } else {
                                0
                            };
                            let out = self.held[..self.held.len() - keep].to_string();
                            self.held.drain(..self.held.len() - keep);
                            add(&mut parts, Part::Content(out));
                            return parts;
                        }
                    }
                }
                Mode::Call => match self.held.find(CALL_END) {
                    Some(at) => {
                        let body = self.held[..at].to_string();
                        self.held.drain(..at + CALL_END.len());
                        parts.push(tool_call(&body));
                        self.mode = Mode::Content;
                    }
                    None => return parts,
                },
            }
        }
    }

    /// What is left at the end of the answer: held text as what it was, an unfinished tool
    /// call as content (the model did not finish it).
    pub fn finish(&mut self) -> Vec<Part> {
        let held = std::mem::take(&mut self.held);
        let mut parts = Vec::new();
        match self.mode {
            Mode::Reasoning => add(&mut parts, Part::Reasoning(held)),
            Mode::Call => add(&mut parts, Part::Content(format!("{CALL}{held}"))),
            Mode::Start | Mode::Content => add(&mut parts, Part::Content(held)),
        }
        self.mode = Mode::Content;
        parts
    }
}

/// The parts of `text` fed to `splitter` in pieces of `piece` bytes (widened to character
/// boundaries), then finished, adjacent text parts of one kind joined: what a whole answer
/// splits into, whatever its pieces were (the tests and the fuzz target check that).
pub fn split_in_pieces(mut splitter: Splitter, text: &str, piece: usize) -> Vec<Part> {
    let mut parts = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut at = piece.clamp(1, rest.len());
        while !rest.is_char_boundary(at) {
            at += 1;
        }
        parts.extend(splitter.push(&rest[..at]));
        rest = &rest[at..];
    }
    parts.extend(splitter.finish());
    let mut joined: Vec<Part> = Vec::new();
    for p in parts {
        match (joined.last_mut(), &p) {
            (Some(Part::Content(a)), Part::Content(b)) | (Some(Part::Reasoning(a)), Part::Reasoning(b)) => {
                a.push_str(b)
            }
            _ => joined.push(p),
        }
    }
    joined
}

/// Adds a text part unless it is empty.
fn add(parts: &mut Vec<Part>, p: Part) {
    match &p {
        Part::Reasoning(t) | Part::Content(t) if t.is_empty() => {}
        _ => parts.push(p),
    }
}

/// How many bytes at the end of `s` could begin one of `tags`.
fn partial_tag(s: &str, tags: &[&str]) -> usize {
    let mut keep = 0;
    for tag in tags {
        for n in (1..tag.len()).rev() {
            if n <= s.len() && s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]) {
                keep = keep.max(n);
                break;
            }
        }
    }
    keep
}

/// A tool call's body: `{"name": ..., "arguments": {...}}` or the XML form. A body that is
/// neither comes back as content, tags included.
fn tool_call(body: &str) -> Part {
    let b = body.trim();
    if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(b) {
        if let Some(name) = o.get("name").and_then(Value::as_str) {
            let arguments = match o.get("arguments").or_else(|| o.get("parameters")) {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => "{}".to_string(),
            };
            return Part::ToolCall {
                name: name.to_string(),
                arguments,
            };
        }
    }
    if let Some(call) = xml_call(b) {
        return call;
    }
    Part::Content(format!("{CALL}{body}{CALL_END}"))
}

/// `<function=NAME> <parameter=P> V </parameter> ... </function>`, each value JSON where it
/// parses as JSON, else the text.
fn xml_call(b: &str) -> Option<Part> {
    let rest = b.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    rest = rest.trim().strip_suffix("</function>")?;
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let r = rest.strip_prefix("<parameter=")?;
        let (key, r) = r.split_once('>')?;
        let (value, r) = r.split_once("</parameter>")?;
        let value = value.trim_matches('\n');
        let v = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
        args.insert(key.trim().to_string(), v);
        rest = r;
    }
    Some(Part::ToolCall {
        name: name.trim().to_string(),
        arguments: Value::Object(args).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str, n: usize, thinking: bool, opened: bool, tools: bool) -> Vec<Part> {
        split_in_pieces(Splitter::new(thinking, opened, tools), text, n)
    }

    fn all_sizes(text: &str, thinking: bool, opened: bool, tools: bool, want: &[Part]) {
        for n in 1..=text.len() {
            assert_eq!(split(text, n, thinking, opened, tools), want, "pieces of {n}");
        }
    }

    #[test]
    fn thinking_and_content_split() {
        let want = [
            Part::Reasoning("I should greet.\n".into()),
            Part::Content("Hello! é".into()),
        ];
        all_sizes(
            "<think>I should greet.\n</think>\n\nHello! é",
            true,
            false,
            false,
            &want,
        );
        all_sizes("I should greet.\n</think>\n\nHello! é", true, true, false, &want);
        // No thinking section: all content; a model without the tags is never split.
        all_sizes(
            "Hello <think>",
            true,
            false,
            false,
            &[Part::Content("Hello <think>".into())],
        );
        all_sizes(
            "<think>x</think>y",
            false,
            false,
            false,
            &[Part::Content("<think>x</think>y".into())],
        );
        // Cut off while thinking.
        all_sizes(
            "<think>hmm </thi",
            true,
            false,
            false,
            &[Part::Reasoning("hmm </thi".into())],
        );
    }

    #[test]
    fn tool_calls_parse_in_both_forms() {
        let json_form = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        all_sizes(
            json_form,
            false,
            false,
            true,
            &[
                Part::Content("Let me look.\n".into()),
                Part::ToolCall {
                    name: "weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into(),
                },
            ],
        );
        let xml = "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        all_sizes(
            xml,
            false,
            false,
            true,
            &[Part::ToolCall {
                name: "weather".into(),
                arguments: r#"{"city":"Paris","days":3}"#.into(),
            }],
        );
        // Without tools the tags are text; a broken call comes back as text; an unfinished
        // one too.
        all_sizes(json_form, false, false, false, &[Part::Content(json_form.into())]);
        let broken = "<tool_call>not a call</tool_call>";
        all_sizes(broken, false, false, true, &[Part::Content(broken.into())]);
        all_sizes(
            "<tool_call>{\"na",
            false,
            false,
            true,
            &[Part::Content("<tool_call>{\"na".into())],
        );
    }
}
