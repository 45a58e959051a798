//! `kestrel chat` from a script on stdin (no terminal): two turns, the second reusing the first's
//! caches, `/clear` starting over, `/system`, an unknown command, `/exit`.

mod common;

use std::io::Write as _;
use std::process::{Command, Stdio};

use common::model_dir;

#[test]
fn scripted_conversation() {
    let d = model_dir("chat", None);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "chat",
            "-m",
            d.0.to_str().unwrap(),
            "--backend",
            "cpu",
            "-n",
            "6",
            "--temp",
            "0",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(
            b"Hello there\nAnd then?\n/clear\nHello there\n/nope\n/system Be brief.\nHi\n/exit\nnever read\n",
        )
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let (out, err) = (
        String::from_utf8(o.stdout).unwrap(),
        String::from_utf8(o.stderr).unwrap(),
    );
    assert!(o.status.success(), "{err}");
    let turns: Vec<&str> = err.lines().filter(|l| l.contains("tokens reused")).collect();
    assert_eq!(turns.len(), 4, "four answers before /exit: {err}");
    let reused = |l: &str| {
        l.trim_start_matches('(')
            .split(' ')
            .next()
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    assert_eq!(reused(turns[0]), 0);
    assert!(
        reused(turns[1]) > 0,
        "the second turn reuses the first: {}",
        turns[1]
    );
    assert_eq!(reused(turns[2]), 0, "/clear starts over");
    assert_eq!(reused(turns[3]), 0, "/system starts over");
    assert!(err.contains("unknown command /nope"), "{err}");
    assert!(err.contains("conversation cleared"), "{err}");
    // The same greedy answer to the same first message, before and after /clear.
    let first = out.lines().next().unwrap_or_default();
    assert!(!first.is_empty() && out.matches(first).count() >= 2, "{out}");
}
