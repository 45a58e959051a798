//! The command line against an adversarial user, on the CPU: each case was a defect (a file of
//! the user's overwritten, a panic, a silent or misleading result) and is now an error exit that
//! names the cause, or a quiet exit where Unix tools are quiet.

mod common;

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use common::{model_dir, TempDir};

fn fixture(name: &str) -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name)
}

fn kestrel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .output()
        .unwrap()
}

/// `kestrel run -m MODEL ARGS --backend cpu`.
fn run_cpu(model: &str, args: &[&str]) -> Output {
    kestrel(&[&["run", "-m", model][..], args, &["--backend", "cpu"]].concat())
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Fails unless `o` is an error exit (status 1 or clap's 2, not a panic's 101 or a signal)
/// whose stderr holds every one of `want`.
fn refused(o: &Output, want: &[&str], what: &str) {
    let err = stderr(o);
    assert!(
        matches!(o.status.code(), Some(1 | 2)),
        "{what}: exit {:?}: {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{what}: {err}");
    for w in want {
        assert!(err.contains(w), "{what}: {w:?} not in {err}");
    }
}

fn temp(tag: &str) -> TempDir {
    let d = TempDir(std::env::temp_dir().join(format!("kestrel-hard-{tag}-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&d.0);
    d
}

fn ids(n: usize) -> String {
    (0..n)
        .map(|i| (i % 200 + 1).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn quantize_never_overwrites_and_refuses_what_would_do_nothing() {
    let model = fixture("qwen3");
    let out = temp("quant-out");
    std::fs::create_dir_all(&out.0).unwrap();
    // A folder of the user's without config.json: nothing in it may change.
    let mine = [
        ("model.safetensors", "the user's weights"),
        ("tokenizer.json", "the user's tokenizer"),
        ("model-00001-of-00002.safetensors", "a stale shard"),
    ];
    for (name, text) in mine {
        std::fs::write(out.0.join(name), text).unwrap();
    }
    let o = kestrel(&[
        "quantize",
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.0.to_str().unwrap(),
        "--quant",
        "q4",
    ]);
    refused(&o, &["is not empty", "overwritten"], "a non-empty --out");
    let mut names: Vec<String> = std::fs::read_dir(&out.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "nothing added: {names:?}");
    for (name, text) in mine {
        assert_eq!(std::fs::read_to_string(out.0.join(name)).unwrap(), text, "{name}");
    }
    // A group size no matrix fits quantises nothing: refused before anything is written.
    let fresh = temp("quant-fresh");
    let o = kestrel(&[
        "quantize",
        "--model",
        model.to_str().unwrap(),
        "--out",
        fresh.0.to_str().unwrap(),
        "--quant",
        "q4",
        "--group-size",
        "4096",
    ]);
    refused(&o, &["4096", "nothing would be quantised"], "--group-size 4096");
    assert!(!fresh.0.exists(), "no directory left behind");
    // --quant is required, as --help says.
    let o = kestrel(&[
        "quantize",
        "--model",
        model.to_str().unwrap(),
        "--out",
        fresh.0.to_str().unwrap(),
    ]);
    refused(&o, &["--quant"], "no --quant");
    // An empty directory is fine, and gets a model.
    std::fs::create_dir_all(&fresh.0).unwrap();
    let o = kestrel(&[
        "quantize",
        "--model",
        model.to_str().unwrap(),
        "--out",
        fresh.0.to_str().unwrap(),
        "--quant",
        "q8",
        "--group-size",
        "32",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(fresh.0.join("config.json").is_file() && fresh.0.join("model.safetensors").is_file());
}

/// Runs `args` with stdout on `/dev/full`.
fn to_full_disk(args: &[&str]) -> Output {
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .stdout(full)
        .output()
        .unwrap()
}

/// Runs `args` with stdout a pipe whose reader has gone.
fn to_closed_pipe(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

#[test]
fn an_unwritable_stdout_is_an_error_and_a_closed_pipe_a_quiet_exit() {
    let model = fixture("qwen3_moe");
    let m = model.to_str().unwrap();
    let cases: [Vec<&str>; 5] = [
        vec!["inspect", "-m", m],
        vec!["inspect", "-m", m, "--json"],
        vec![
            "run",
            "-m",
            m,
            "--prompt-tokens",
            "1,2,3",
            "-n",
            "4",
            "--backend",
            "cpu",
            "--json",
        ],
        vec![
            "bench",
            "-m",
            m,
            "-p",
            "4",
            "-n",
            "2",
            "-r",
            "1",
            "--backend",
            "cpu",
        ],
        vec!["doctor"],
    ];
    for args in &cases {
        let o = to_full_disk(args);
        refused(
            &o,
            &["writing to stdout", "No space left"],
            &format!("{args:?} > /dev/full"),
        );
        let o = to_closed_pipe(args);
        let err = stderr(&o);
        assert!(o.status.success(), "{args:?} | (closed): {:?} {err}", o.status);
        assert!(
            !err.contains("panicked") && !err.contains("error"),
            "{args:?}: {err}"
        );
    }
    // Streamed text, too.
    let o = to_full_disk(&[
        "run",
        "-m",
        m,
        "--prompt-tokens",
        "1,2,3",
        "-n",
        "4",
        "--backend",
        "cpu",
    ]);
    refused(&o, &["No space left"], "run > /dev/full");
    // An unwritable stderr cannot say why, but the exit status does.
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "run",
            "-m",
            m,
            "--prompt-tokens",
            "1,2,3",
            "-n",
            "4",
            "--backend",
            "cpu",
        ])
        .stderr(full)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "2> /dev/full");
}

#[test]
fn prompts_past_the_trained_length_are_refused_with_both_numbers() {
    let model = fixture("qwen3");
    let m = model.to_str().unwrap();
    // The fixture was made for 128 positions.
    let long = ids(130);
    let run = |args: &[&str]| run_cpu(m, args);
    for (args, want, what) in [
        (
            vec!["--prompt-tokens", &long, "-n", "4"],
            vec!["130 tokens", "128 positions", "--allow-long-context"],
            "run, 130 tokens",
        ),
        (
            vec!["--prompt-tokens", "1,2", "-c", "200"],
            vec!["200", "128 positions"],
            "run -c 200",
        ),
        // Allowed past the trained length, a context the host cannot hold is an error, not an
        // abort, and one past 32-bit positions is refused.
        (
            vec![
                "--prompt-tokens",
                "1,2",
                "-c",
                "4000000000",
                "--allow-long-context",
            ],
            vec!["out of memory", "bytes"],
            "-c 4e9",
        ),
        (
            vec![
                "--prompt-tokens",
                "1,2",
                "-n",
                "100000000000",
                "--allow-long-context",
            ],
            vec!["100000000002 positions", "4294967295"],
            "-n 1e11",
        ),
        // A prompt file that never ends is refused at a bound, not read into memory.
        (
            vec!["-f", "/dev/zero"],
            vec!["/dev/zero", "more than 64 MiB"],
            "-f /dev/zero",
        ),
    ] {
        refused(&run(&args), &want, what);
    }
    let out = temp("long-logits");
    let file = out.0.with_extension("safetensors");
    let o = kestrel(&[
        "logits",
        "-m",
        m,
        "--tokens",
        &long,
        "--backend",
        "cpu",
        "--out",
        file.to_str().unwrap(),
    ]);
    refused(&o, &["130 tokens", "128 positions"], "logits, 130 tokens");
    assert!(!file.exists());
    // Allowed explicitly, it runs; a prefill in chunks shows its progress.
    let o = run(&[
        "--prompt-tokens",
        &long,
        "-n",
        "2",
        "--allow-long-context",
        "--prefill-chunk",
        "40",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("prefill: 30% (40 of 130 tokens)"), "{err}");
    // Without -c the new tokens stop at the trained length, and say so.
    let o = run(&["--prompt-tokens", &ids(100), "-n", "50", "--json"]);
    let err = stderr(&o);
    assert!(o.status.success() && err.contains("-n 50 stops at 28"), "{err}");
    let out = String::from_utf8(o.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 28);
}

#[test]
fn a_long_prompt_prefills_in_chunks_with_progress_by_default() {
    let model = fixture("qwen3");
    let long = ids(4200);
    let o = kestrel(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "--prompt-tokens",
        &long,
        "-n",
        "1",
        "--backend",
        "cpu",
        "--allow-long-context",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("prefill: 48% (2048 of 4200 tokens)"), "{err}");
}

#[test]
fn misleading_results_are_errors_or_true_figures() {
    let model = fixture("qwen3");
    let m = model.to_str().unwrap();
    let o = kestrel(&["run", "-m", "/nonexistent/kestrel-model", "-p", "hi"]);
    refused(
        &o,
        &["/nonexistent/kestrel-model", "does not exist"],
        "a missing directory",
    );
    // -n 0 runs the prompt: a real prompt speed, and text "" when there is a tokenizer.
    let d = model_dir("hard-n0", None);
    let dir = d.0.to_str().unwrap();
    let o = run_cpu(dir, &["-p", "Hello there", "-n", "0"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("prompt:"))
        .expect("a prompt line");
    let rate: f64 = line
        .rsplit('(')
        .next()
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(rate > 0.0 && rate < 1e8, "{line}");
    let o = run_cpu(dir, &["-p", "Hello there", "-n", "0", "--json"]);
    let out = String::from_utf8(o.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(v["text"], "");
    assert!(v["prefill_s"].as_f64().unwrap() > 0.0);
    // Arithmetic past the address space is refused, not shown saturated.
    let o = kestrel(&["inspect", "-m", m, "--ctx", "18446744073709551615"]);
    refused(&o, &["--ctx 18446744073709551615"], "inspect --ctx 2^64-1");
    // Flags that would do nothing, or less than asked; negative numbers parse, then fail the
    // range check with the range.
    for (flag, want, what) in [
        (["--stop", ""], ["--stop", "non-empty"], "--stop \"\""),
        (
            ["--prefill-chunk", "0"],
            ["--prefill-chunk", "at least 1"],
            "--prefill-chunk 0",
        ),
        (
            ["--temp", "-1"],
            ["temperature -1", "0 (greedy) or more"],
            "--temp -1",
        ),
        (["--top-p", "-0.5"], ["top-p -0.5", "at most 1"], "--top-p -0.5"),
    ] {
        refused(
            &run_cpu(m, &[&["--prompt-tokens", "1,2"][..], &flag].concat()),
            &want,
            what,
        );
    }
    // A file of the user's is never overwritten by --out.
    let out = temp("logits-out");
    std::fs::write(&out.0, "mine").unwrap();
    let o = kestrel(&[
        "logits",
        "-m",
        m,
        "--tokens",
        "1,2",
        "--backend",
        "cpu",
        "--out",
        out.0.to_str().unwrap(),
    ]);
    refused(&o, &["exists"], "logits --out over a file");
    assert_eq!(std::fs::read_to_string(&out.0).unwrap(), "mine");
    let _ = std::fs::remove_file(&out.0);
}

#[test]
fn bad_files_are_named() {
    // A generation config out of range names the file and the range.
    let d = model_dir("hard-genconf", None);
    std::fs::write(d.0.join("generation_config.json"), r#"{"temperature": -5}"#).unwrap();
    let o = kestrel(&["run", "-m", d.0.to_str().unwrap(), "-p", "hi", "--backend", "cpu"]);
    refused(
        &o,
        &["generation_config.json", "temperature -5", "out of range"],
        "temperature -5",
    );
    // A tensor whose range is wrong is named, not the header's first or the next one.
    let dir = temp("bad-offset");
    std::fs::create_dir_all(&dir.0).unwrap();
    let src = fixture("qwen3");
    std::fs::copy(src.join("config.json"), dir.0.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut names: Vec<(u64, String)> = header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (v["data_offsets"][0].as_u64().unwrap(), k.clone()))
        .collect();
    names.sort();
    for (k, (shift_start, what)) in [(false, "do not hold its shape"), (true, "leaves a gap")]
        .into_iter()
        .enumerate()
    {
        let victim = names[names.len() / 2 + k].1.clone();
        let mut h = header.clone();
        let offsets = h[&victim]["data_offsets"].as_array_mut().unwrap();
        let end = offsets[1].as_u64().unwrap();
        offsets[1] = (end + 2).into();
        if shift_start {
            let start = offsets[0].as_u64().unwrap();
            offsets[0] = (start + 2).into();
        }
        let mut text = serde_json::to_vec(&h).unwrap();
        text.resize(text.len().div_ceil(8) * 8, b' ');
        let mut file = (text.len() as u64).to_le_bytes().to_vec();
        file.extend(&text);
        file.extend(&bytes[8 + n..]);
        std::fs::write(dir.0.join("model.safetensors"), &file).unwrap();
        let o = kestrel(&["inspect", "-m", dir.0.to_str().unwrap()]);
        refused(
            &o,
            &["model.safetensors", &format!("tensor {victim}"), what],
            &victim,
        );
    }
}

#[test]
fn a_bad_configuration_variable_stops_only_what_reads_it() {
    let model = fixture("qwen3");
    let m = model.to_str().unwrap();
    let with = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .args(args)
            .env("KESTREL_PDL", "sometimes")
            .output()
            .unwrap()
    };
    let o = with(&[
        "run",
        "-m",
        m,
        "--prompt-tokens",
        "1,2",
        "-n",
        "2",
        "--backend",
        "cpu",
    ]);
    assert!(o.status.success(), "a CPU run: {}", stderr(&o));
    let o = with(&["doctor", "--kernel-options"]);
    assert!(o.status.success(), "doctor --kernel-options: {}", stderr(&o));
    let o = with(&["doctor"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("KESTREL_PDL=\"sometimes\" is invalid"),
        "doctor: {out}"
    );
    // The CUDA backend reads it: refused, naming the variable (before any device is looked for).
    let o = with(&[
        "run",
        "-m",
        m,
        "--prompt-tokens",
        "1,2",
        "-n",
        "2",
        "--backend",
        "cuda",
    ]);
    refused(&o, &["KESTREL_PDL", "sometimes"], "a CUDA run");
}

#[test]
fn a_conversation_that_outgrows_the_context_says_what_to_do() {
    let d = model_dir("hard-chat", None);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "chat",
            "-m",
            d.0.to_str().unwrap(),
            "--backend",
            "cpu",
            "-n",
            "4",
            "--temp",
            "0",
            "-c",
            "40",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let long = "tell me more about it ".repeat(6);
    let script = format!("Hi\n{long}\n/clear\nHi\n/exit\n");
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("the context holds 40") && err.contains("/clear") && err.contains("larger -c"),
        "{err}"
    );
    // After /clear the conversation goes on.
    let turns = err.lines().filter(|l| l.contains("tokens reused")).count();
    assert_eq!(turns, 2, "{err}");
}

#[test]
fn chat_input_without_line_breaks_is_refused_at_a_bound() {
    let d = model_dir("hard-chat-zero", None);
    let zero = std::fs::File::open("/dev/zero").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["chat", "-m", d.0.to_str().unwrap(), "--backend", "cpu"])
        .stdin(zero)
        .output()
        .unwrap();
    refused(&o, &["longer than 64 MiB"], "chat < /dev/zero");
}
