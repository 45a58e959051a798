//! Chat templates: the Jinja template a model ships (`chat_template` in `tokenizer_config.json`,
//! or `chat_template.jinja`) rendered with minijinja the way transformers renders it: blocks
//! trimmed and left-stripped, Python's string and dict methods, a `tojson` that writes what
//! Python's `json.dumps` writes, `raise_exception(message)` as an error carrying the message, and
//! `strftime_now(format)`. Templates come from downloaded files, so rendering is sandboxed:
//! minijinja has no file or network access, a fuel budget bounds the work, and the output is
//! capped in size.

use std::fmt::Write as _;
use std::io;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::error::{Result, TextError};

/// Instructions a render may execute (a Qwen3 conversation of 50 turns takes about 60,000).
const FUEL: u64 = 50_000_000;
/// Bytes a render may write.
const MAX_OUTPUT: usize = 16 << 20;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

/// What a template is rendered with.
#[derive(Debug, Clone, Default)]
pub struct ChatInput<'a> {
    /// The conversation: objects with `role` and `content` (and whatever else the template
    /// reads: `tool_calls`, `reasoning_content`, ...).
    pub messages: &'a [Json],
    /// Tool descriptions (JSON schemas), when the conversation has tools.
    pub tools: Option<&'a [Json]>,
    /// End with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Special tokens the template may print.
    pub bos_token: Option<&'a str>,
    pub eos_token: Option<&'a str>,
    /// Other variables (`enable_thinking`, `date_string`, ...); they win over the above.
    pub extra: Map<String, Json>,
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is an error naming its line.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TextError::Template(describe(&e)))?;
        Ok(ChatTemplate { env })
    }

    /// Renders the conversation.
    pub fn render(&self, input: &ChatInput) -> Result<String> {
        let mut ctx = Map::new();
        ctx.insert("messages".into(), Json::Array(input.messages.to_vec()));
        if let Some(tools) = input.tools {
            ctx.insert("tools".into(), Json::Array(tools.to_vec()));
        }
        ctx.insert("add_generation_prompt".into(), input.add_generation_prompt.into());
        if let Some(b) = input.bos_token {
            ctx.insert("bos_token".into(), b.into());
        }
        if let Some(e) = input.eos_token {
            ctx.insert("eos_token".into(), e.into());
        }
        for (k, v) in &input.extra {
            ctx.insert(k.clone(), v.clone());
        }
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TextError::Template(describe(&e)))?;
        let mut out = Capped(Vec::new());
        template
            .render_captured_to(&ctx, &mut out)
            .map_err(|e| TextError::Template(describe(&e)))?;
        String::from_utf8(out.0).map_err(|_| TextError::Template("the template wrote invalid UTF-8".into()))
    }
}

/// A writer that refuses to grow past `MAX_OUTPUT`.
struct Capped(Vec<u8>);

impl io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.0.len() + buf.len() > MAX_OUTPUT {
            return Err(io::Error::other(format!("the output passed {MAX_OUTPUT} bytes")));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The error's message with its cause chain (a raised exception's text, the line at fault).
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        let _ = write!(s, ": {inner}");
        source = inner.source();
    }
    s
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("the template raised an exception: {message}"),
    ))
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)`, as transformers' `tojson` filter.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump(&value, indent, 0, &mut out)?;
    Ok(Value::from(out))
}

fn dump(v: &Value, indent: Option<usize>, level: usize, out: &mut String) -> std::result::Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    // Python's separators: ", " between items without an indent, "," with one.
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                let _ = write!(out, "{i}");
            } else {
                let f = f64::try_from(v.clone())?;
                if !f.is_finite() {
                    let s = if f.is_nan() {
                        "NaN"
                    } else if f > 0.0 {
                        "Infinity"
                    } else {
                        "-Infinity"
                    };
                    out.push_str(s);
                } else if f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else {
                    let _ = write!(out, "{f}");
                }
            }
        }
        ValueKind::String => string(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                dump(item, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                match key.as_str() {
                    Some(k) => string(k, out),
                    None => string(&key.to_string(), out),
                }
                out.push_str(": ");
                dump(&v.get_item(key)?, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        _ => string(&v.to_string(), out),
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The UTC date and time now, formatted with the strftime directives templates use
/// (`%d %b %B %m %Y %y %H %M %S %%`).
fn strftime_now(format: String) -> std::result::Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)?))
}

/// `format` applied to the UTC time `secs` after the Unix epoch.
fn strftime(format: &str, secs: i64) -> std::result::Result<String, Error> {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => write!(out, "{d:02}"),
            Some('b') => write!(out, "{}", &MONTHS[m as usize - 1][..3]),
            Some('B') => write!(out, "{}", MONTHS[m as usize - 1]),
            Some('m') => write!(out, "{m:02}"),
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('H') => write!(out, "{:02}", rem / 3600),
            Some('M') => write!(out, "{:02}", rem / 60 % 60),
            Some('S') => write!(out, "{:02}", rem % 60),
            Some('%') => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: directive %{} is not supported",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
        .expect("writing to a String cannot fail");
    }
    Ok(out)
}

/// (year, month, day) of a day count from 1970-01-01 (the proleptic Gregorian calendar).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_722), (2023, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        // 2026-11-21 12:34:56 UTC
        let t = 1_795_264_496;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "21 Nov 2026");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %B %y %%", t).unwrap(),
            "2026-11-21 12:34:56 November 26 %"
        );
        assert!(strftime("%Q", t).is_err());
    }
}
