//! Chat templates: the Jinja template a model ships (`chat_template` in `tokenizer_config.json`,
//! or `chat_template.jinja`) rendered with minijinja the way transformers renders it: blocks
//! trimmed and left-stripped, Python's string and dict methods, a `tojson` that writes what
//! Python's `json.dumps` writes, a `string` filter and printing (`{{ value }}`) that write lists,
//! dicts and floats as Python's `str` does (`['integer', 'null']`, `1e+16`),
//! `raise_exception(message)` as an error carrying the message, `strftime_now(format)`, macros, and
//! `loop.previtem`/`loop.nextitem`. `include`, `import` and `extends` parse, but there is no loader
//! and the only template is the chat template itself: naming any other is an error that names it,
//! and no file is read. (`~` still joins a list as minijinja writes it, `["a"]`: operators cannot
//! be overridden.)
//!
//! Templates come from downloaded files, so rendering is sandboxed, within these bounds
//! ([`RenderLimits`]; the defaults are far above what real templates use: a 50-turn Qwen3
//! conversation with tools takes about 60,000 instructions, under 8 MiB and a few milliseconds):
//!
//! - no file or network access: minijinja has none, and no loader is set;
//! - fuel: 50 million instructions ([`RenderLimits::fuel`]), a few seconds in a debug build;
//! - output: 16 MiB of rendered text ([`RenderLimits::output`]);
//! - memory: 64 MiB held by the render at once ([`RenderLimits::memory`]), which catches what
//!   fuel cannot: a template that doubles a string or list forty times runs few instructions but
//!   would ask for terabytes (and abort the process);
//! - time: 10 s of wall-clock time ([`RenderLimits::time`]), which catches single instructions
//!   that are slow on large values;
//! - nesting: `tojson`, `string` and printing go at most 512 levels into a nested value (Python
//!   stops near 1000); the memory budget bounds how deeply a template can nest a value, and the
//!   render's stack is sized for minijinja's own recursions over the deepest such value
//!   (dropping it, `'' ~ value`), which would otherwise overflow it and abort.
//!
//! Each render runs on a thread of its own ([`crate::sandbox`]), always, so the time bound holds
//! whether or not [`crate::BoundedAlloc`] is the global allocator; the memory bound holds only
//! where it is (the `kestrel` binary installs it). Passing the memory or time bound is an error
//! (`TextError::Template`) naming the bound, never an abort. A render stopped that way may leave its
//! thread parked for good, holding minijinja's locks and at most the memory bound, so the
//! template leaves that environment to it and compiles a fresh one for the next render (a server
//! goes on serving after a hostile conversation); after [`MAX_ABANDONED`] such stops it refuses
//! every later render with an error saying why, so parked threads cannot pile up. Running out of
//! fuel or output is an ordinary template error, and the template stays usable.

use std::fmt::Write as _;
use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::error::{Result, TextError};
use crate::sandbox::{self, Stopped};

/// The bounds a render runs within.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderLimits {
    /// minijinja instructions a render may execute (a Qwen3 conversation of 50 turns takes about
    /// 60,000).
    pub fuel: u64,
    /// Bytes the rendered text may have.
    pub output: usize,
    /// Bytes the render may hold at once: the conversation as minijinja values, the values the
    /// template builds, and the output (enforced where [`crate::BoundedAlloc`] is installed).
    pub memory: usize,
    /// Wall-clock time a render may take.
    pub time: Duration,
}

impl Default for RenderLimits {
    fn default() -> RenderLimits {
        RenderLimits {
            fuel: 50_000_000,
            output: 16 << 20,
            memory: 64 << 20,
            time: Duration::from_secs(10),
        }
    }
}

/// Renders stopped by the memory or time bound (each may leave a parked thread holding up to
/// the memory bound) before a template refuses to render.
pub const MAX_ABANDONED: usize = 4;

/// A compiled chat template.
pub struct ChatTemplate {
    source: String,
    limits: RenderLimits,
    state: Mutex<State>,
}

/// The environment renders use, and the renders stopped so far.
struct State {
    env: Arc<Environment<'static>>,
    /// Why each stopped render was stopped.
    abandoned: Vec<String>,
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
    /// Compiles `source` to render within the default [`RenderLimits`]; a syntax error is an
    /// error naming its line.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        ChatTemplate::with_limits(source, RenderLimits::default())
    }

    /// Compiles `source` to render within `limits`.
    pub fn with_limits(source: &str, limits: RenderLimits) -> Result<ChatTemplate> {
        Ok(ChatTemplate {
            source: source.to_string(),
            limits,
            state: Mutex::new(State {
                env: Arc::new(compile(source, limits)?),
                abandoned: Vec::new(),
            }),
        })
    }

    /// The same template compiled again, with an environment of its own (for another thread of
    /// a server, say).
    pub fn fork(&self) -> Result<ChatTemplate> {
        ChatTemplate::with_limits(&self.source, self.limits)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Renders the conversation, on a thread of its own within the template's limits.
    pub fn render(&self, input: &ChatInput) -> Result<String> {
        let env = {
            let state = self.state();
            if state.abandoned.len() >= MAX_ABANDONED {
                return Err(TextError::Template(format!(
                    "{MAX_ABANDONED} earlier renders of this template were stopped (the last: {}) and \
                     their threads may still hold memory, so it renders no more; fix the template \
                     or the input and load the model again",
                    state.abandoned.last().map_or("", String::as_str)
                )));
            }
            Arc::clone(&state.env)
        };
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
        let RenderLimits {
            output, memory, time, ..
        } = self.limits;
        match sandbox::run(memory, time, move || render_in(&env, &ctx, output)) {
            Ok(rendered) => rendered,
            Err(stopped) => Err(self.stop(stopped)),
        }
    }

    /// The error for a render the sandbox stopped; one that may have left its thread parked
    /// marks the template unusable.
    fn stop(&self, stopped: Stopped) -> TextError {
        let why = match stopped {
            Stopped::Memory {
                budget,
                used,
                refused,
            } => format!(
                "rendering needed more than {} of memory (it held {} and asked for {} more): \
                 the template builds a value without bound, such as a string or list doubled in a \
                 loop; fix the template",
                size(budget),
                size(used.max(0) as usize),
                size(refused)
            ),
            Stopped::Time { limit } => format!(
                "rendering took longer than {} s (the template spends long on large values, or the \
                 machine is overloaded) and was abandoned; fix the template",
                limit.as_secs_f64()
            ),
            Stopped::Panic(message) => {
                return TextError::Template(format!(
                    "the template engine panicked ({message}); this is a bug in minijinja or \
                     Kestrel: report it with the template"
                ))
            }
            Stopped::Spawn(e) => {
                return TextError::Template(format!(
                    "could not start a thread to render on ({e}); the process may be at its thread limit"
                ))
            }
        };
        // The stopped thread may hold the environment's locks: later renders get a fresh one.
        let mut state = self.state();
        state.abandoned.push(why.clone());
        if let Ok(env) = compile(&self.source, self.limits) {
            state.env = Arc::new(env);
        }
        TextError::Template(why)
    }
}

/// `source` compiled as the template `chat`, with the Python-compatible filters and functions
/// and `limits`' fuel.
fn compile(source: &str, limits: RenderLimits) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(limits.fuel));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_filter("string", py_string);
    env.set_formatter(py_formatter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned("chat", source.to_string())
        .map_err(|e| TextError::Template(describe(&e)))?;
    Ok(env)
}

/// Renders the template `chat` of `env` with the variables `ctx`, at most `cap` bytes of it.
fn render_in(env: &Environment<'static>, ctx: &Map<String, Json>, cap: usize) -> Result<String> {
    let template = env
        .get_template("chat")
        .map_err(|e| TextError::Template(describe(&e)))?;
    let mut out = Capped { buf: Vec::new(), cap };
    template
        .render_captured_to(ctx, &mut out)
        .map_err(|e| TextError::Template(describe(&e)))?;
    String::from_utf8(out.buf).map_err(|_| TextError::Template("the template wrote invalid UTF-8".into()))
}

/// `bytes` in MiB when it is at least one, else in bytes.
fn size(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        let mib = bytes as f64 / f64::from(1 << 20);
        if bytes % (1 << 20) == 0 {
            format!("{mib} MiB")
        } else {
            format!("{mib:.1} MiB")
        }
    } else {
        format!("{bytes} bytes")
    }
}

/// A writer that refuses to grow past `cap` bytes.
struct Capped {
    buf: Vec<u8>,
    cap: usize,
}

impl io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.buf.len() + buf.len() > self.cap {
            return Err(io::Error::other(format!("the output passed {} bytes", self.cap)));
        }
        self.buf.extend_from_slice(buf);
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
    too_deep(level)?;
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
        ValueKind::Number if v.is_integer() => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Number => {
            let f = f64::try_from(v.clone())?;
            let s = if f.is_nan() {
                "NaN".into()
            } else if f.is_infinite() {
                (if f > 0.0 { "Infinity" } else { "-Infinity" }).into()
            } else {
                py_float(f)
            };
            out.push_str(&s);
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

/// `{{ value }}` as Jinja2 writes it: lists, dicts and floats as Python's `str` writes them
/// (`['a', 1e+16]` where minijinja writes `["a", 10000000000000000.0]`), the rest as minijinja
/// writes it (which already writes `True`, `None` and strings as Python does).
fn py_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &Value,
) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(value, 0, &mut s)?;
            out.write_str(&s).map_err(Error::from)
        }
        ValueKind::Number if !value.is_integer() => out
            .write_str(&py_float(f64::try_from(value.clone())?))
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// The `string` filter as Jinja2's: Python's `str(value)`, so `['integer', 'null']` for a list
/// (templates print JSON-schema types that way), and an empty string for an undefined value.
fn py_string(value: &Value) -> std::result::Result<Value, Error> {
    Ok(match value.kind() {
        ValueKind::String => value.clone(),
        ValueKind::Undefined => Value::from(""),
        _ => {
            let mut s = String::new();
            py_repr(value, 0, &mut s)?;
            Value::from(s)
        }
    })
}

/// Python's `repr(value)` for the values templates hold (and `str(value)` for all but strings).
/// Strings are escaped as Python escapes them, except that of the characters Python deems
/// unprintable only the control characters, line and paragraph separators and common
/// zero-width and non-breaking spaces are escaped; others (unassigned, private-use) are written
/// as they are.
fn py_repr(value: &Value, depth: usize, out: &mut String) -> std::result::Result<(), Error> {
    too_deep(depth)?;
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => {
            let _ = write!(out, "{value}");
        }
        ValueKind::Number => out.push_str(&py_float(f64::try_from(value.clone())?)),
        ValueKind::String => py_repr_str(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, depth + 1, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, depth + 1, out)?;
                out.push_str(": ");
                py_repr(&value.get_item(&key)?, depth + 1, out)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// How deep `tojson`, `string` and printing go into nested values: Python stops near 1000
/// (its recursion limit), and the render thread's stack is not sized for the millions of levels
/// a memory budget allows.
const MAX_DEPTH: usize = 512;

fn too_deep(depth: usize) -> std::result::Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("a value is nested more than {MAX_DEPTH} levels deep"),
        ));
    }
    Ok(())
}

/// A string as Python's `repr` writes it: in single quotes, or in double quotes when it has a
/// single quote and no double quote.
fn py_repr_str(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa1).contains(&(c as u32)) || c == '\u{ad}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            '\u{1680}'
            | '\u{2000}'..='\u{200f}'
            | '\u{2028}'..='\u{202f}'
            | '\u{205f}'..='\u{2064}'
            | '\u{3000}'
            | '\u{feff}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// A finite float as Python's `repr` writes it: the shortest digits that read back the same,
/// positional from 1e-4 up to 1e16, else with an exponent of at least two digits (`1e+16`,
/// `1.5e-05`), and always with a point or an exponent (`2.0`).
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return (if f > 0.0 { "inf" } else { "-inf" }).into();
    }
    if f == 0.0 {
        return (if f.is_sign_negative() { "-0.0" } else { "0.0" }).into();
    }
    // Rust's `{:e}` writes the same shortest digits, as `1.5e-5`.
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let positional = format!("{f}");
        if positional.contains('.') {
            positional
        } else {
            positional + ".0"
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
    }
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
    fn floats_as_python_writes_them() {
        for (f, want) in [
            (2.0, "2.0"),
            (0.1, "0.1"),
            (-1.5, "-1.5"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (-0.0, "-0.0"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (f64::NAN, "nan"),
            (f64::NEG_INFINITY, "-inf"),
        ] {
            assert_eq!(py_float(f), want, "{f:e}");
        }
    }

    #[test]
    fn repr_as_python_writes_it() {
        let repr = |v: Value| {
            let mut s = String::new();
            py_repr(&v, 0, &mut s).unwrap();
            s
        };
        let v = Value::from_serialize(serde_json::json!(["a", "it's", 1, 2.5, null, true, {"k": "v"}, 1e16]));
        assert_eq!(repr(v), r#"['a', "it's", 1, 2.5, None, True, {'k': 'v'}, 1e+16]"#);
        assert_eq!(
            repr(Value::from("a'b\"c\\\n\u{7}\u{a0}\u{200b}é")),
            r#"'a\'b"c\\\n\x07\xa0\u200bé'"#
        );
        assert_eq!(py_string(&Value::UNDEFINED).unwrap().as_str(), Some(""));
        assert_eq!(py_string(&Value::from("x")).unwrap().as_str(), Some("x"));
        let mut deep = Value::from(1);
        for _ in 0..600 {
            deep = Value::from(vec![deep]);
        }
        let err = py_repr(&deep, 0, &mut String::new()).unwrap_err().to_string();
        assert!(err.contains("nested more than 512 levels"), "{err}");
        let mut s = String::new();
        assert!(dump(&deep, None, 0, &mut s).is_err());
    }

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
