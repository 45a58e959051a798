//! A model directory with one file corrupted (truncated, bytes flipped, the safetensors header
//! length changed), under every subcommand that opens a model: each run ends, within a time
//! limit, in success (a corruption that still parses, such as flipped weight bytes) or in an
//! error exit whose message names the corrupted file; never a panic, an abort or a hang. The
//! corruptions are drawn afresh on each run from a printed seed (`KESTREL_TEST_SEED` repeats
//! one).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{model_dir, TempDir};
use kestrel_core::rng::Rng;

/// How long one run may take before it counts as a hang (a CPU run of the tiny model takes
/// well under a second).
const LIMIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy)]
enum Corruption {
    /// Cut to a random length.
    Truncate,
    /// A few random bytes flipped (in a safetensors file, half of them in the header).
    Flip,
    /// The safetensors header length set to another value.
    HeaderLength,
}

fn corrupt(bytes: &mut Vec<u8>, how: Corruption, safetensors: bool, rng: &mut Rng) -> String {
    match how {
        Corruption::Truncate => {
            let keep = rng.range(0, bytes.len());
            bytes.truncate(keep);
            format!("truncated to {keep} bytes")
        }
        Corruption::Flip => {
            let header = if safetensors && bytes.len() >= 8 {
                (8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize).min(bytes.len())
            } else {
                bytes.len()
            };
            let n = rng.range(1, 9);
            let mut at = Vec::new();
            for i in 0..n {
                let end = if i % 2 == 0 { header } else { bytes.len() };
                let p = rng.range(0, end);
                bytes[p] ^= 1 << rng.range(0, 8);
                at.push(p);
            }
            format!("bits flipped at {at:?}")
        }
        Corruption::HeaderLength => {
            let len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
            let new = match rng.range(0, 4) {
                0 => u64::MAX - rng.range(0, 1000) as u64,
                1 => len + rng.range(1, 64) as u64,
                2 => len.saturating_sub(rng.range(1, 64) as u64),
                _ => bytes.len() as u64 + rng.range(0, 1 << 20) as u64,
            };
            bytes[..8].copy_from_slice(&new.to_le_bytes());
            format!("header length {len} set to {new}")
        }
    }
}

/// The subcommands that open a model, on `dir` (`out` a path they may create).
fn commands(dir: &Path, out: &Path) -> Vec<(&'static str, Vec<String>, Option<&'static str>)> {
    let d = dir.to_str().unwrap().to_string();
    let o = out.to_str().unwrap().to_string();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let mut run = s(&["run", "-m", &d, "-p", "Hello", "-n", "3", "--backend", "cpu"]);
    run.extend(s(&["--temp", "0"]));
    vec![
        ("run", run, None),
        (
            "run ids",
            s(&[
                "run",
                "-m",
                &d,
                "--prompt-tokens",
                "1,2,3",
                "-n",
                "3",
                "--backend",
                "cpu",
            ]),
            None,
        ),
        ("inspect", s(&["inspect", "-m", &d]), None),
        (
            "logits",
            s(&[
                "logits",
                "-m",
                &d,
                "--tokens",
                "1,2,3",
                "--backend",
                "cpu",
                "--out",
                &format!("{o}.st"),
            ]),
            None,
        ),
        (
            "bench",
            s(&[
                "bench",
                "-m",
                &d,
                "-p",
                "3",
                "-n",
                "2",
                "-r",
                "1",
                "--backend",
                "cpu",
            ]),
            None,
        ),
        (
            "chat",
            s(&["chat", "-m", &d, "-n", "3", "--backend", "cpu"]),
            Some("Hello\n/exit\n"),
        ),
        (
            "quantize",
            s(&[
                "quantize",
                "--model",
                &d,
                "--out",
                &o,
                "--quant",
                "q8",
                "--group-size",
                "32",
            ]),
            None,
        ),
    ]
}

/// Runs `args`, feeding `stdin`; (exit code, stderr), or a failure if it outlives [`LIMIT`].
fn run_limited(args: &[String], stdin: Option<&str>, what: &str) -> (Option<i32>, String) {
    use std::io::{Read as _, Write as _};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let _ = input.write_all(stdin.unwrap_or("").as_bytes());
    drop(input);
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = err.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {LIMIT:?} (a hang)");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    (status.code(), reader.join().unwrap())
}

#[test]
fn a_corrupted_file_is_an_error_naming_it_under_every_subcommand() {
    let seed = kestrel_testing::seed("corrupted files");
    let mut rng = Rng::new(seed);
    let base = model_dir("corrupt-base", None);
    let files = [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ];
    let mut runs = 0;
    let mut errors = 0;
    for file in files {
        let safetensors = file.ends_with(".safetensors");
        let mut hows = vec![Corruption::Truncate, Corruption::Flip, Corruption::Flip];
        if safetensors {
            hows.extend([
                Corruption::HeaderLength,
                Corruption::HeaderLength,
                Corruption::Truncate,
            ]);
        }
        for how in hows {
            let dir = TempDir(PathBuf::from(format!("{}-{file}-{runs}", base.0.display())));
            let _ = std::fs::remove_dir_all(&dir.0);
            std::fs::create_dir_all(&dir.0).unwrap();
            for f in std::fs::read_dir(&base.0).unwrap() {
                let f = f.unwrap();
                std::fs::copy(f.path(), dir.0.join(f.file_name())).unwrap();
            }
            let mut bytes = std::fs::read(dir.0.join(file)).unwrap();
            let done = corrupt(&mut bytes, how, safetensors, &mut rng);
            std::fs::write(dir.0.join(file), &bytes).unwrap();
            let out = TempDir(dir.0.with_extension("out"));
            for (name, args, stdin) in commands(&dir.0, &out.0) {
                let what = format!("seed {seed}: {name} with {file} {done}");
                let (code, err) = run_limited(&args, stdin, &what);
                runs += 1;
                assert!(
                    matches!(code, Some(0 | 1)),
                    "{what}: exit {code:?} (a panic is 101, a signal none): {err}"
                );
                assert!(!err.contains("panicked"), "{what}: {err}");
                if code == Some(1) {
                    errors += 1;
                    // chat prints a failed turn and goes on; its error names the file too.
                    let message = err
                        .lines()
                        .filter(|l| l.contains("error"))
                        .collect::<Vec<_>>()
                        .join("\n");
                    assert!(
                        message.contains(file),
                        "{what}: the error does not name {file}: {err}"
                    );
                }
                let _ = std::fs::remove_file(out.0.with_extension("out.st"));
                let _ = std::fs::remove_dir_all(&out.0);
            }
        }
    }
    eprintln!("{runs} runs, {errors} error exits");
    assert!(
        errors > runs / 4,
        "most corruptions must be caught: {errors} of {runs}"
    );
}
