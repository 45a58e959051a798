//! The one path everything the command line prints goes through. `outln!`/`out!` write stdout
//! and return an error when it cannot be written (a full disk, a closed pipe), so a command stops
//! with an error exit instead of a panic; `main` turns a closed pipe into a quiet exit, as Unix
//! tools do (`kestrel run ... | head -1`). `errln!` writes stderr, which carries diagnostics and
//! progress: a failure there cannot be reported anywhere, so it is remembered and makes the exit
//! status a failure ([`stderr_failed`]).

use std::fmt;
use std::io::{self, Write as _};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set when a write to stderr failed.
static STDERR_FAILED: AtomicBool = AtomicBool::new(false);

/// Stdout could not be written.
#[derive(Debug, thiserror::Error)]
#[error("writing to stdout")]
pub struct StdoutError(#[source] pub io::Error);

/// Writes `args` to stdout and flushes it, so a failure shows here and not at exit.
pub fn stdout(args: fmt::Arguments) -> Result<(), StdoutError> {
    let mut o = io::stdout().lock();
    o.write_fmt(args).and_then(|()| o.flush()).map_err(StdoutError)
}

/// Writes raw text to stdout (generated text as it streams), as an `io::Result` for callbacks.
pub fn stdout_text(s: &str) -> io::Result<()> {
    let mut o = io::stdout().lock();
    o.write_all(s.as_bytes())?;
    o.flush()
}

/// Writes `args` to stderr; a failure is remembered (see [`stderr_failed`]).
pub fn stderr(args: fmt::Arguments) {
    let mut e = io::stderr().lock();
    if e.write_fmt(args).and_then(|()| e.flush()).is_err() {
        STDERR_FAILED.store(true, Ordering::Relaxed);
    }
}

/// Whether a write to stderr failed during the run.
pub fn stderr_failed() -> bool {
    STDERR_FAILED.load(Ordering::Relaxed)
}

/// Whether `e` comes from writing to a pipe whose reader has gone (stdout to `head`, say).
pub fn is_closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe)
    })
}

/// `println!` to stdout through [`stdout`]: evaluates to `Result<(), StdoutError>`.
macro_rules! outln {
    () => {
        $crate::out::stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` to stdout through [`stdout`]: evaluates to `Result<(), StdoutError>`.
#[allow(unused_macros)]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::stdout(format_args!($($arg)*))
    };
}

/// `eprintln!` through [`stderr`].
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::out::stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}
