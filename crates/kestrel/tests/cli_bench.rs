//! `kestrel bench` on the CPU backend: a synthetic model of a named real configuration cut to
//! one layer, and a fixture directory; the JSON carries every test with positive rates and the
//! parameter count worked out by hand from the published sizes.

use std::process::Command;

fn bench(args: &[&str]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .arg("bench")
        .args(args)
        .args(["--backend", "cpu", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(String::from_utf8(o.stdout).unwrap().lines().last().unwrap()).unwrap()
}

fn rates(v: &serde_json::Value) -> Vec<(String, f64, usize)> {
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let n = r["samples_tokens_per_s"].as_array().unwrap().len();
            (
                r["test"].as_str().unwrap().to_string(),
                r["tokens_per_s"].as_f64().unwrap(),
                n,
            )
        })
        .collect()
}

#[test]
fn synthetic_qwen3_30b_a3b_one_layer() {
    let v = bench(&[
        "--synthetic",
        "qwen3-30b-a3b",
        "--layers",
        "1",
        "-p",
        "6",
        "-n",
        "3",
        "-r",
        "2",
    ]);
    let r = rates(&v);
    assert_eq!(r.iter().map(|t| t.0.as_str()).collect::<Vec<_>>(), ["pp6", "tg3"]);
    assert!(r.iter().all(|t| t.1 > 0.0 && t.2 == 2), "{r:?}");
    // Embedding and lm_head 151936 x 2048; attention q 4096 x 2048, k and v 512 x 2048, o
    // 2048 x 4096, head norms 2 x 128; router 128 x 2048; 128 experts of 3 x 768 x 2048; two
    // layer norms and the final norm of 2048.
    let (h, experts) = (2048u64, 128 * 3 * 768 * 2048u64);
    let total = 2 * 151936 * h + 2 * 4096 * h + 2 * 512 * h + 2 * 128 + 128 * h + experts + 3 * h;
    assert_eq!(v["parameters"], total);
    assert_eq!(
        v["active_parameters_per_token"],
        total - experts + experts * 8 / 128
    );
    assert!(v["cuda_counters"].is_null());
}

#[test]
fn model_directory_and_bad_arguments() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity/qwen3_next");
    let v = bench(&[
        "-m",
        dir.to_str().unwrap(),
        "-p",
        "9,4",
        "-n",
        "5",
        "-r",
        "3",
        "--prefill-chunk",
        "4",
    ]);
    let names: Vec<String> = rates(&v).into_iter().map(|t| t.0).collect();
    assert_eq!(names, ["pp9", "pp4", "tg5"]);
    for (args, want) in [
        (vec![], "--model DIR or --synthetic NAME"),
        (vec!["--synthetic", "qwen2"], "qwen3-30b-a3b"),
        (vec!["--synthetic", "qwen3-30b-a3b", "--layers", "0"], "48 layers"),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .arg("bench")
            .args(&args)
            .args(["--backend", "cpu"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    }
}

/// `-d`: every test runs after that many held tokens (the context holds them and the test),
/// named as llama-bench names it.
#[test]
fn tests_run_at_a_depth() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity/qwen3_next");
    let v = bench(&[
        "-m",
        dir.to_str().unwrap(),
        "-p",
        "4",
        "-n",
        "3",
        "-d",
        "29",
        "-r",
        "2",
    ]);
    let names: Vec<String> = rates(&v).into_iter().map(|t| t.0).collect();
    assert_eq!(names, ["pp4 @ d29", "tg3 @ d29"]);
    for t in v["results"].as_array().unwrap() {
        assert_eq!(t["n_depth"], 29, "{t}");
    }
}

/// `-b` adds batched generation tests after the others, named by their batch, their rate
/// counting every sequence's tokens; for a hybrid model (a state row per sequence) as for one
/// with attention only; `--batched-one` adds one sequence through the batched steps first
/// (`x1`). A batch of 0 is refused.
#[test]
fn batched_generation_tests_run_at_each_batch() {
    for name in ["qwen3_next", "qwen3_moe"] {
        let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name);
        let v = bench(&[
            "-m",
            dir.to_str().unwrap(),
            "-p",
            "0",
            "-n",
            "3",
            "-b",
            "1,2,5",
            "-d",
            "7",
            "-r",
            "2",
        ]);
        let names: Vec<String> = rates(&v).into_iter().map(|t| t.0).collect();
        assert_eq!(names, ["tg3 @ d7", "tg3 x2 @ d7", "tg3 x5 @ d7"], "{name}");
        let batches: Vec<u64> = v["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["n_batch"].as_u64().unwrap())
            .collect();
        assert_eq!(batches, [1, 2, 5], "{name}");
        let v = bench(&[
            "-m",
            dir.to_str().unwrap(),
            "-p",
            "0",
            "-n",
            "3",
            "-b",
            "2",
            "--batched-one",
            "-r",
            "1",
        ]);
        let names: Vec<String> = rates(&v).into_iter().map(|t| t.0).collect();
        assert_eq!(names, ["tg3", "tg3 x1", "tg3 x2"], "{name}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["bench", "-b", "0", "-n", "2"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("-b counts"));
}

/// With experts streamed (about the smallest budget `inspect` names, so steps evict), each
/// generation run reports the bytes it copied per token beside its rate, and the one-run cache
/// statistics are there.
#[test]
fn streamed_generation_runs_report_their_own_bytes() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity/qwen3_moe");
    let dir = dir.to_str().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "inspect",
            "-m",
            dir,
            "--ctx",
            "5",
            "--prefill-chunk",
            "4",
            "--cache",
            "f32",
        ])
        .args(["--gpu-mem", "1TiB", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // A slot more than the least: the bench's activations differ from inspect's by a little.
    let p = &v["placement"];
    let min = (p["min_gpu_bytes"].as_u64().unwrap() + p["expert_span_bytes"].as_u64().unwrap()).to_string();
    let v = bench(&[
        "-m",
        dir,
        "-p",
        "4",
        "-n",
        "5",
        "-r",
        "3",
        "--gpu-mem",
        &min,
        "--tg-input",
        "random",
    ]);
    let tg = &v["results"][1];
    assert_eq!(tg["test"], "tg5");
    let copied: Vec<f64> = tg["samples_bytes_copied_per_token"]
        .as_array()
        .unwrap_or_else(|| panic!("no bytes per run: {tg}"))
        .iter()
        .map(|b| b.as_f64().unwrap())
        .collect();
    assert_eq!(copied.len(), 3, "{tg}");
    assert!(copied.iter().all(|&b| b > 0.0), "{copied:?}");
    assert!(v["results"][0].get("samples_bytes_copied_per_token").is_none());
    assert!(
        v["expert_cache"]["bytes_copied_per_token"].as_f64().unwrap() > 0.0,
        "{v}"
    );
}
