//! `kestrel bench serve`: a load generator for an OpenAI-compatible server, as `vllm bench serve`
//! is. N clients send streamed `/v1/completions` requests of random token ids (prompt and answer
//! lengths given, `ignore_eos` so every answer has its length) until the requests are done, and
//! the run reports request throughput, output tokens/s, time to first token and inter-token
//! latency (median and p99), and from a Kestrel server, where its engine spent the run (its
//! `/metrics`). Against `--url`, or a `kestrel serve` it starts itself (`-m DIR`,
//! `--synthetic NAME`, or the built-in model) and stops at the end.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use kestrel_core::rng::Rng;
use serde_json::{json, Value};

use crate::args::SyntheticArgs;

#[derive(Args)]
pub struct ServeBenchArgs {
    /// The server's address, e.g. http://127.0.0.1:8080 (default: start `kestrel serve` with
    /// the model given here, on a free port).
    #[arg(long, conflicts_with_all = ["model", "synthetic"])]
    url: Option<String>,
    /// The model directory of the server started (default: the built-in model).
    #[arg(short = 'm', long, conflicts_with = "synthetic")]
    model: Option<PathBuf>,
    #[command(flatten)]
    synthetic: SyntheticArgs,
    /// More flags for the server started, e.g. `--server-arg=--gpu-mem=16GiB` (repeatable).
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Clients sending requests at once.
    #[arg(short = 'c', long, default_value_t = 1, value_parser = crate::args::at_least_one)]
    concurrency: usize,
    /// Requests in all (default: four a client).
    #[arg(short = 'n', long)]
    num_prompts: Option<usize>,
    /// Tokens of each prompt (random ids).
    #[arg(long, default_value_t = 512, value_parser = crate::args::at_least_one)]
    prompt_len: usize,
    /// Tokens of each answer.
    #[arg(long, default_value_t = 128, value_parser = crate::args::at_least_one)]
    output_len: usize,
    /// Sampling temperature of every request (0: greedy; the server checks the range); each
    /// request's seed is its index.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k of every request (0: the server's default; sampled requests only).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed of the prompts' ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The key the server asks for (`--api-key`).
    #[arg(long)]
    api_key: Option<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// A server this command started, stopped when dropped.
struct Started(Child);

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `kestrel serve` on a free port: its process and base URL.
fn start_server(a: &ServeBenchArgs) -> Result<(Started, String)> {
    let exe = std::env::current_exe().context("finding the kestrel binary to start the server")?;
    let mut cmd = Command::new(exe);
    cmd.args(["serve", "--port", "0"]);
    if let Some(m) = &a.model {
        cmd.arg("-m").arg(m);
    }
    cmd.args(a.synthetic.flags());
    if let Some(k) = &a.api_key {
        cmd.args(["--api-key", k]);
    }
    cmd.args(&a.server_args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = Started(cmd.spawn().context("starting kestrel serve")?);
    let stderr = child.0.stderr.take().context("the server's stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let mut base = None;
    for line in lines.by_ref() {
        let line = line.context("reading the server's stderr")?;
        errln!("server: {line}");
        if let Some(at) = line.find("http://") {
            base = line[at..].split("/v1").next().map(str::to_string);
            break;
        }
    }
    let base = base.context("the server stopped before listening")?;
    // Pass the rest of its stderr through (loading, errors).
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            errln!("server: {line}");
        }
    });
    Ok((child, base))
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(3600)))
        .build()
        .into()
}

/// Waits until `/health` answers 200 (the model has loaded), at most `limit`.
fn wait_ready(agent: &ureq::Agent, base: &str, limit: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        match agent.get(format!("{base}/health")).call() {
            Ok(r) if r.status() == 200 => return Ok(()),
            Ok(r) if r.status() != 503 => bail!("{base}/health answered {}", r.status()),
            _ => {}
        }
        ensure!(
            start.elapsed() < limit,
            "{base} was not ready after {} s",
            limit.as_secs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What one request measured.
struct Timing {
    /// Seconds to the first token, then between tokens, and in all.
    ttft: f64,
    gaps: Vec<f64>,
    total: f64,
    tokens: usize,
}

/// The model's name and vocabulary size from `/v1/models`.
fn model_info(agent: &ureq::Agent, base: &str, key: Option<&str>) -> Result<(String, usize)> {
    let mut req = agent.get(format!("{base}/v1/models"));
    if let Some(k) = key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let mut r = req.call().with_context(|| format!("asking {base}/v1/models"))?;
    let text = r.body_mut().read_to_string()?;
    ensure!(
        r.status() == 200,
        "{base}/v1/models answered {}: {text}",
        r.status()
    );
    let v: Value = serde_json::from_str(&text).context("reading /v1/models")?;
    let m = &v["data"][0];
    let name = m["id"].as_str().context("/v1/models names no model")?.to_string();
    // A server that does not say its vocabulary gets ids every tokenizer of this size has.
    let vocab = m["vocab_size"].as_u64().map_or(32_000, |v| v as usize);
    Ok((name, vocab))
}

/// Sends one streamed completion request and times its tokens.
fn one_request(agent: &ureq::Agent, base: &str, key: Option<&str>, body: &Value) -> Result<Timing> {
    let start = Instant::now();
    let mut req = agent
        .post(format!("{base}/v1/completions"))
        .header("Content-Type", "application/json");
    if let Some(k) = key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let r = req.send(body.to_string()).context("sending a request")?;
    let status = r.status();
    let mut reader = BufReader::new(r.into_body().into_reader());
    if status != 200 {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut reader, &mut text)?;
        bail!("the server answered {status}: {text}");
    }
    let (mut first, mut last) = (None::<Instant>, None::<Instant>);
    let mut gaps = Vec::new();
    let mut tokens = None;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).context("reading the answer")? == 0 {
            break;
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).context("a chunk that is not JSON")?;
        if let Some(e) = v.get("error") {
            bail!("the server failed mid-answer: {e}");
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            tokens = u["completion_tokens"].as_u64().map(|t| t as usize);
        }
        // A chunk a token; the one with the finish reason carries none.
        let token = v["choices"].get(0).is_some_and(|c| c["finish_reason"].is_null());
        if token {
            let now = Instant::now();
            match last {
                None => first = Some(now),
                Some(t) => gaps.push(now.duration_since(t).as_secs_f64()),
            }
            last = Some(now);
        }
    }
    let first = first.context("the answer had no tokens")?;
    Ok(Timing {
        ttft: first.duration_since(start).as_secs_f64(),
        gaps,
        total: start.elapsed().as_secs_f64(),
        tokens: tokens.context("the answer had no usage")?,
    })
}

/// A Kestrel server's engine counters from `/metrics` (`kestrel_engine_*`, summed over their
/// labels' values by name and kind); None from a server that has none.
fn engine_counters(agent: &ureq::Agent, base: &str) -> Option<Vec<(String, f64)>> {
    let mut r = agent.get(format!("{base}/metrics")).call().ok()?;
    if r.status() != 200 {
        return None;
    }
    let text = r.body_mut().read_to_string().ok()?;
    let mut out: Vec<(String, f64)> = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("kestrel_engine_")) {
        let (name, value) = line.rsplit_once(' ')?;
        let kind = name.split("kind=\"").nth(1).and_then(|k| k.split('"').next());
        let metric = name.split('{').next()?;
        let key = match kind {
            Some(k) => format!("{metric}:{k}"),
            None => metric.to_string(),
        };
        out.push((key, value.parse().ok()?));
    }
    (!out.is_empty()).then_some(out)
}

/// What the engine's counters moved by between two readings, as a JSON object.
fn engine_delta(before: &[(String, f64)], after: &[(String, f64)]) -> Value {
    let get = |v: &[(String, f64)], k: &str| v.iter().find(|(n, _)| n == k).map_or(0.0, |(_, x)| *x);
    let d = |k: &str| get(after, k) - get(before, k);
    json!({
        "prompt_steps": d("kestrel_engine_steps_total:prompt"),
        "prompt_step_seconds": d("kestrel_engine_step_seconds_total:prompt"),
        "prompt_tokens": d("kestrel_engine_step_tokens_total:prompt"),
        "prompt_chunks": d("kestrel_engine_prompt_chunks_total"),
        "decode_steps": d("kestrel_engine_steps_total:decode"),
        "decode_step_seconds": d("kestrel_engine_step_seconds_total:decode"),
        "decoded_tokens": d("kestrel_engine_step_tokens_total:decode"),
        "programs_prepared": d("kestrel_engine_programs_prepared_total"),
        "program_seconds": d("kestrel_engine_program_seconds_total"),
        "programs_evicted": d("kestrel_engine_programs_evicted_total"),
    })
}

/// The `q` quantile of `v` (nearest rank), 0 for none.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

pub fn run(a: ServeBenchArgs) -> Result<std::process::ExitCode> {
    let num = a.num_prompts.unwrap_or(4 * a.concurrency);
    ensure!(num >= 1, "--num-prompts must be at least 1");
    let (server, base) = match &a.url {
        Some(u) => (None, u.trim_end_matches('/').to_string()),
        None => {
            let (s, b) = start_server(&a)?;
            (Some(s), b)
        }
    };
    let agent = agent();
    wait_ready(&agent, &base, Duration::from_secs(3600))?;
    let key = a.api_key.as_deref();
    let (model, vocab) = model_info(&agent, &base, key)?;
    let mut rng = Rng::new(a.seed);
    let prompts: Vec<Vec<u32>> = (0..num)
        .map(|_| {
            (0..a.prompt_len)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect()
        })
        .collect();
    let body = |ids: &[u32], seed: usize| {
        let mut b = json!({
            "model": model,
            "prompt": ids,
            "max_tokens": a.output_len,
            "ignore_eos": true,
            "temperature": a.temperature,
            "seed": seed,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if a.top_k > 0 {
            b["top_k"] = a.top_k.into();
        }
        b
    };
    // One request first, so the server's programs for these lengths exist before timing.
    one_request(&agent, &base, key, &body(&prompts[0], 0)).context("the warm-up request")?;
    let counters = engine_counters(&agent, &base);
    let next = AtomicUsize::new(0);
    let timings = Mutex::new(Vec::with_capacity(num));
    let failures = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..a.concurrency {
            scope.spawn(|| {
                let agent = self::agent();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= num {
                        break;
                    }
                    match one_request(&agent, &base, key, &body(&prompts[i], i)) {
                        Ok(t) => timings.lock().unwrap_or_else(|p| p.into_inner()).push(t),
                        Err(e) => failures
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(format!("{e:#}")),
                    }
                }
            });
        }
    });
    let wall = start.elapsed().as_secs_f64();
    let engine = counters
        .zip(engine_counters(&agent, &base))
        .map(|(before, after)| engine_delta(&before, &after));
    drop(server);
    let timings = timings.into_inner().unwrap_or_else(|p| p.into_inner());
    let failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some(f) = failures.first() {
        errln!("{} of {num} requests failed; the first: {f}", failures.len());
    }
    ensure!(!timings.is_empty(), "no request succeeded");
    let tokens: usize = timings.iter().map(|t| t.tokens).sum();
    let mut ttft: Vec<f64> = timings.iter().map(|t| t.ttft).collect();
    let mut itl: Vec<f64> = timings.iter().flat_map(|t| t.gaps.iter().copied()).collect();
    let mut e2e: Vec<f64> = timings.iter().map(|t| t.total).collect();
    let ms = |v: f64| v * 1e3;
    let report = json!({
        "url": base,
        "model": model,
        "concurrency": a.concurrency,
        "prompt_len": a.prompt_len,
        "output_len": a.output_len,
        "temperature": a.temperature,
        "top_k": a.top_k,
        "requests": num,
        "completed": timings.len(),
        "failed": failures.len(),
        "duration_s": wall,
        "request_throughput": timings.len() as f64 / wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens as f64 / wall,
        "total_tokens_per_s": (tokens + timings.len() * a.prompt_len) as f64 / wall,
        "ttft_ms": {"median": ms(quantile(&mut ttft, 0.5)), "p99": ms(quantile(&mut ttft, 0.99))},
        "itl_ms": {"median": ms(quantile(&mut itl, 0.5)), "p99": ms(quantile(&mut itl, 0.99))},
        "latency_ms": {"median": ms(quantile(&mut e2e, 0.5)), "p99": ms(quantile(&mut e2e, 0.99))},
        "engine": engine,
    });
    if a.json {
        outln!("{report}")?;
    } else {
        outln!(
            "{model} at {base}: {} clients, prompts {} tokens, answers {} tokens{}",
            a.concurrency,
            a.prompt_len,
            a.output_len,
            match (a.temperature > 0.0, a.top_k) {
                (false, _) => String::new(),
                (true, 0) => format!(", sampled at temperature {}", a.temperature),
                (true, k) => format!(", sampled at temperature {} from the top {k}", a.temperature),
            }
        )?;
        outln!(
            "requests: {} of {num} completed in {wall:.2} s ({:.2} requests/s)",
            timings.len(),
            report["request_throughput"].as_f64().unwrap_or(0.0)
        )?;
        outln!(
            "output: {tokens} tokens, {:.1} tokens/s",
            report["output_tokens_per_s"].as_f64().unwrap_or(0.0)
        )?;
        for (name, key) in [
            ("time to first token", "ttft_ms"),
            ("inter-token latency", "itl_ms"),
            ("request latency", "latency_ms"),
        ] {
            outln!(
                "{name}: median {:.2} ms, p99 {:.2} ms",
                report[key]["median"].as_f64().unwrap_or(0.0),
                report[key]["p99"].as_f64().unwrap_or(0.0)
            )?;
        }
        if let Some(e) = report["engine"].as_object() {
            let f = |k: &str| e[k].as_f64().unwrap_or(0.0);
            let mean = |secs: f64, steps: f64| if steps > 0.0 { secs / steps * 1e3 } else { 0.0 };
            outln!(
                "engine: {:.0} steps with prompt tokens ({:.0} tokens in {:.0} chunks, mean {:.2} ms), \
                 {:.0} decoding only ({:.0} tokens decoded in all, mean {:.2} ms); {:.2} of {wall:.2} \
                 s in steps; {:.0} programs prepared in {:.2} s ({:.0} dropped for memory)",
                f("prompt_steps"),
                f("prompt_tokens"),
                f("prompt_chunks"),
                mean(f("prompt_step_seconds"), f("prompt_steps")),
                f("decode_steps"),
                f("decoded_tokens"),
                mean(f("decode_step_seconds"), f("decode_steps")),
                f("prompt_step_seconds") + f("decode_step_seconds"),
                f("programs_prepared"),
                f("program_seconds"),
                f("programs_evicted"),
            )?;
        }
    }
    Ok(if failures.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}
