//! `kestrel serve` on the built-in model, on the CPU, through a real HTTP client: greedy answers
//! (plain and streamed, chat and text completions) equal `kestrel run --json`; concurrent
//! requests each get what they get alone; a client that disconnects mid-stream has its request
//! stopped; every error case answers its status with an OpenAI error object naming the field;
//! `/health`, `/v1/models` and `/metrics` parse.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A `kestrel serve` process on a free port, killed when dropped.
struct Server {
    child: Child,
    base: String,
    agent: ureq::Agent,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

impl Server {
    /// Starts `kestrel serve --port 0 --backend cpu ARGS` and waits until `/health` says ready.
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .args(["serve", "--port", "0", "--backend", "cpu"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        err.read_line(&mut line).unwrap();
        let at = line
            .find("http://")
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        let base = line[at..].split("/v1").next().unwrap().to_string();
        // Keep draining stderr so the server never blocks on it.
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        let server = Server {
            child,
            base,
            agent: agent(),
        };
        let start = Instant::now();
        loop {
            let (status, _) = server.get("/health");
            if status == 200 {
                break;
            }
            assert_eq!(status, 503, "/health while loading");
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the model did not load"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn get(&self, path: &str) -> (u16, String) {
        let mut r = self.agent.get(format!("{}{path}", self.base)).call().unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    /// POSTs `body` (raw bytes) with `headers`: (status, body).
    fn post_raw(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> (u16, String) {
        let mut req = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Content-Type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let mut r = req.send(body).unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.post_raw(path, body.to_string().as_bytes(), &[]);
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )
    }

    /// A streamed request: every `data:` payload before `[DONE]`, parsed.
    fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let r = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let mut text = String::new();
        r.into_body().into_reader().read_to_string(&mut text).unwrap();
        let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }
}

/// `kestrel run --json` on the CPU.
fn run_json(args: &[&str]) -> Value {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["run", "--backend", "cpu", "--json", "--temp", "0"])
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

fn chat_body(question: &str, max_tokens: usize) -> Value {
    json!({
        "model": "kestrel-tiny",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

fn content(answer: &Value) -> &str {
    answer["choices"][0]["message"]["content"].as_str().unwrap()
}

const QUESTIONS: [&str; 4] = [
    "What does os.path.join do?",
    "How do I read a file line by line?",
    "What is a dictionary comprehension?",
    "Explain json.dumps.",
];

#[test]
fn greedy_answers_equal_run() {
    let s = Server::start(&[]);
    let q = QUESTIONS[0];
    let want = run_json(&["-p", q, "-n", "24"]);
    let (status, got) = s.post("/v1/chat/completions", &chat_body(q, 24));
    assert_eq!(status, 200, "{got}");
    assert_eq!(content(&got), want["text"].as_str().unwrap());
    assert_eq!(got["object"], "chat.completion");
    assert_eq!(got["usage"]["prompt_tokens"], want["prompt_tokens"]);
    assert_eq!(
        got["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        want["tokens"].as_array().unwrap().len()
    );
    let reason = if want["stop_reason"] == "length" {
        "length"
    } else {
        "stop"
    };
    assert_eq!(got["choices"][0]["finish_reason"], reason);

    // Streamed: the deltas join to the same text; the role comes first, the usage last.
    let mut body = chat_body(q, 24);
    body["stream"] = true.into();
    body["stream_options"] = json!({"include_usage": true});
    let chunks = s.stream("/v1/chat/completions", &body);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, content(&got));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    // The same counts (the cached tokens differ: the second request reuses the first's caches).
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][k], got["usage"][k], "{k}");
    }
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], reason);

    // A text completion of token ids equals `run --prompt-tokens`.
    let ids = [1u32, 562, 912, 7, 30];
    let want = run_json(&["--prompt-tokens", "1,562,912,7,30", "-n", "12"]);
    let (status, got) = s.post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["object"], "text_completion");
    assert_eq!(got["choices"][0]["text"], want["text"]);
}

/// Sixteen requests at once against each alone: batched over 16 slots (the default), over 3
/// (requests wait for slots), and one at a time (as models with recurrent states run).
#[test]
fn concurrent_requests_each_get_what_they_get_alone() {
    for args in [&[][..], &["--max-num-seqs", "3"], &["--max-num-seqs", "1"]] {
        concurrent_against_alone(args);
    }
}

fn concurrent_against_alone(args: &[&str]) {
    let s = Server::start(args);
    let alone: Vec<String> = QUESTIONS
        .iter()
        .map(|q| content(&s.post("/v1/chat/completions", &chat_body(q, 16)).1).to_string())
        .collect();
    let together: Vec<(usize, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let s = &s;
                scope.spawn(move || {
                    let q = QUESTIONS[i % QUESTIONS.len()];
                    let (status, got) = s.post("/v1/chat/completions", &chat_body(q, 16));
                    assert_eq!(status, 200, "{got}");
                    (i, content(&got).to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, text) in together {
        assert_eq!(text, alone[i % QUESTIONS.len()], "{args:?}: request {i}");
    }
}

/// The value of the metric line starting with `name` in `/metrics`' text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}

#[test]
fn a_client_that_disconnects_stops_its_request() {
    let s = Server::start(&[]);
    let mut body = chat_body(QUESTIONS[1], 1500);
    body["stream"] = true.into();
    body["ignore_eos"] = true.into();
    let r = s
        .agent
        .post(format!("{}/v1/chat/completions", s.base))
        .send(body.to_string())
        .unwrap();
    let mut reader = BufReader::new(r.into_body().into_reader());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
    drop(reader);
    let start = Instant::now();
    loop {
        let (_, m) = s.get("/metrics");
        if metric(
            &m,
            "kestrel_requests_total{model=\"kestrel-tiny\",outcome=\"cancelled\"}",
        ) == 1.0
        {
            assert_eq!(metric(&m, "kestrel_requests_running"), 0.0);
            // 1,500 tokens (past any end-of-sequence) take seconds here: it stopped early.
            assert!(metric(&m, "kestrel_generation_tokens_total") < 1000.0, "{m}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the request was not stopped: {m}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The engine serves the next request.
    let (status, _) = s.post("/v1/chat/completions", &chat_body(QUESTIONS[2], 4));
    assert_eq!(status, 200);
}

/// Checks an error answer: status, OpenAI error object, the field named.
fn assert_error(got: (u16, String), status: u16, param: Option<&str>) {
    assert_eq!(got.0, status, "{}", got.1);
    let v: Value = serde_json::from_str(&got.1).unwrap_or_else(|e| panic!("{e}: {}", got.1));
    assert!(
        v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(v["error"]["type"].is_string(), "{v}");
    assert_eq!(v["error"]["param"].as_str(), param, "{v}");
}

#[test]
fn bad_requests_answer_their_status_and_name_the_field() {
    let s = Server::start(&["--max-body", "4096", "-c", "256"]);
    let chat = |body: &str| s.post_raw("/v1/chat/completions", body.as_bytes(), &[]);
    let hi = r#""messages": [{"role": "user", "content": "Hi"}]"#;
    assert_error(chat("{"), 400, None);
    assert_error(chat("[1]"), 400, None);
    assert_error(
        chat(&format!(r#"{{{hi}, "temperature": "warm"}}"#)),
        400,
        Some("temperature"),
    );
    assert_error(chat(&format!(r#"{{{hi}, "top_p": -1}}"#)), 400, Some("top_p"));
    assert_error(
        chat(&format!(r#"{{{hi}, "max_tokens": -1}}"#)),
        400,
        Some("max_tokens"),
    );
    assert_error(
        chat(&format!(r#"{{{hi}, "max_tokens": 100000}}"#)),
        400,
        Some("max_tokens"),
    );
    assert_error(chat(&format!(r#"{{{hi}, "banana": 1}}"#)), 400, Some("banana"));
    assert_error(
        chat(r#"{"messages": [{"role": "user"}]}"#),
        400,
        Some("messages.0.content"),
    );
    let long = "word ".repeat(300);
    assert_error(
        chat(&json!({"messages": [{"role": "user", "content": long}]}).to_string()),
        400,
        Some("messages"),
    );
    assert_error(
        chat(&format!(r#"{{{hi}, "model": "gpt-9"}}"#)),
        404,
        Some("model"),
    );
    let big = format!(r#"{{{hi}, "user": "{}"}}"#, "x".repeat(5000));
    assert_error(chat(&big), 413, None);
    assert_error(
        s.post_raw("/v1/completions", br#"{"prompt": [999999999]}"#, &[]),
        400,
        Some("prompt.0"),
    );
    assert_error(s.post_raw("/v2/everything", b"{}", &[]), 404, None);
    // The server is still there.
    let (status, _) = s.get("/health");
    assert_eq!(status, 200);
}

#[test]
fn an_api_key_is_required_when_set() {
    let s = Server::start(&["--api-key", "sesame"]);
    let body = chat_body(QUESTIONS[0], 2).to_string();
    assert_error(
        s.post_raw("/v1/chat/completions", body.as_bytes(), &[]),
        401,
        None,
    );
    assert_error(
        s.post_raw(
            "/v1/chat/completions",
            body.as_bytes(),
            &[("Authorization", "Bearer sesamE")],
        ),
        401,
        None,
    );
    let (status, _) = s.post_raw(
        "/v1/chat/completions",
        body.as_bytes(),
        &[("Authorization", "Bearer sesame")],
    );
    assert_eq!(status, 200);
    // Health and metrics stay open, as in vLLM.
    assert_eq!(s.get("/health").0, 200);
    assert_eq!(s.get("/metrics").0, 200);
}

#[test]
fn a_full_queue_answers_429() {
    let s = Server::start(&["--max-queue", "1", "--max-num-seqs", "2"]);
    let long = |seed: u64| {
        let mut b = chat_body(QUESTIONS[3], 1500);
        b["stream"] = true.into();
        b["ignore_eos"] = true.into();
        b["seed"] = seed.into();
        b
    };
    // Two requests running (each has sent its first line), one waiting: the fourth is refused.
    let open = |b: &Value| {
        let r = s
            .agent
            .post(format!("{}/v1/chat/completions", s.base))
            .send(b.to_string())
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        BufReader::new(r.into_body().into_reader())
    };
    let mut line = String::new();
    let mut first = open(&long(1));
    first.read_line(&mut line).unwrap();
    let mut second = open(&long(2));
    second.read_line(&mut line).unwrap();
    let _third = open(&long(3));
    let (status, text) = s.post_raw(
        "/v1/chat/completions",
        chat_body(QUESTIONS[0], 2).to_string().as_bytes(),
        &[],
    );
    assert_error((status, text), 429, None);
}

#[test]
fn health_models_and_metrics_parse() {
    let s = Server::start(&[]);
    let (status, h) = s.get("/health");
    assert_eq!(
        (
            status,
            serde_json::from_str::<Value>(&h).unwrap()["status"].clone()
        ),
        (200, json!("ok"))
    );
    let (status, m) = s.get("/v1/models");
    assert_eq!(status, 200);
    let m: Value = serde_json::from_str(&m).unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "kestrel-tiny");
    assert!(m["data"][0]["max_model_len"].as_u64().unwrap() > 0);
    s.post("/v1/chat/completions", &chat_body(QUESTIONS[0], 3));
    // The worker publishes a step's times once the step is over, which can be just after the
    // answer it finished has reached us: wait for the last decode step.
    let start = Instant::now();
    let text = loop {
        let (status, text) = s.get("/metrics");
        assert_eq!(status, 200);
        let decode_steps = text
            .lines()
            .find(|l| l.starts_with("kestrel_engine_steps_total{") && l.contains("decode"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
        if decode_steps == Some(2.0) || start.elapsed() > Duration::from_secs(10) {
            break text;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Every line is a comment or `name{labels} value` with a number.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let value = line.rsplit(' ').next().unwrap();
        assert!(value.parse::<f64>().is_ok(), "{line}");
    }
    assert_eq!(metric(&text, "kestrel_generation_tokens_total"), 3.0);
    assert_eq!(
        metric(
            &text,
            "kestrel_requests_total{model=\"kestrel-tiny\",outcome=\"ok\"}"
        ),
        1.0
    );
    assert_eq!(metric(&text, "kestrel_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(metric(&text, "kestrel_inter_token_latency_seconds_count"), 2.0);
    // The engine's steps: the prompt's (which gave the first token), then two decoding only.
    let engine = |name: &str, kind: &str| {
        metric(
            &text,
            &format!("{name}{{model=\"kestrel-tiny\",kind=\"{kind}\"}}"),
        )
    };
    assert_eq!(engine("kestrel_engine_step_tokens_total", "decode"), 2.0);
    assert_eq!(engine("kestrel_engine_steps_total", "decode"), 2.0);
    assert!(engine("kestrel_engine_steps_total", "prompt") >= 1.0, "{text}");
    assert!(
        engine("kestrel_engine_step_tokens_total", "prompt") > 3.0,
        "{text}"
    );
    assert!(
        engine("kestrel_engine_step_seconds_total", "decode") > 0.0,
        "{text}"
    );
    assert!(
        metric(&text, "kestrel_engine_programs_prepared_total") >= 1.0,
        "{text}"
    );
    // The built-in model's programs fit: none dropped for memory.
    assert_eq!(
        metric(&text, "kestrel_engine_programs_evicted_total"),
        0.0,
        "{text}"
    );
}

#[test]
fn bench_serve_reports_every_request() {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["bench", "serve", "--concurrency", "3", "--num-prompts", "5"])
        .args([
            "--prompt-len",
            "16",
            "--output-len",
            "7",
            "--json",
            "--server-arg=--backend=cpu",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let out = String::from_utf8(o.stdout).unwrap();
    let v: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(
        (v["completed"].as_u64(), v["failed"].as_u64()),
        (Some(5), Some(0)),
        "{v}"
    );
    // Every answer has its length (`ignore_eos`).
    assert_eq!(v["output_tokens"], 35, "{v}");
    for key in ["ttft_ms", "itl_ms", "latency_ms"] {
        let (median, p99) = (
            v[key]["median"].as_f64().unwrap(),
            v[key]["p99"].as_f64().unwrap(),
        );
        assert!(median > 0.0 && p99 >= median, "{key}: {v}");
    }
    assert!(v["output_tokens_per_s"].as_f64().unwrap() > 0.0);
    // The server's engine over the timed requests: every prompt's 16 tokens, and each
    // answer's tokens after the first (which its prompt's step gave).
    let e = &v["engine"];
    assert_eq!(
        (e["prompt_tokens"].as_f64(), e["decoded_tokens"].as_f64()),
        (Some(80.0), Some(30.0)),
        "{v}"
    );
    assert!(e["prompt_steps"].as_f64().unwrap() >= 1.0, "{v}");
    // The server it started is gone with it.
    assert!(err.contains("server: serving kestrel-tiny"), "{err}");
}

/// The elements of the JSON array `v`, each read by `read`.
fn array<T>(v: &Value, read: impl Fn(&Value) -> Option<T>) -> Vec<T> {
    let items = v.as_array().unwrap_or_else(|| panic!("not an array: {v}"));
    items
        .iter()
        .map(|x| read(x).unwrap_or_else(|| panic!("{x} in {v}")))
        .collect()
}

#[test]
fn logprobs_are_the_models() {
    let s = Server::start(&[]);
    let ids = [1u32, 562, 912, 7, 30];
    let body = json!({"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2});
    let (status, got) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{got}");
    let lp = &got["choices"][0]["logprobs"];
    let token_lps = array(&lp["token_logprobs"], Value::as_f64);
    assert_eq!(token_lps.len(), 3, "{lp}");
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    let offsets = array(&lp["text_offset"], Value::as_u64);
    assert!(
        offsets[0] == 0 && offsets.windows(2).all(|w| w[0] <= w[1]),
        "{offsets:?}"
    );
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 2, "{top:?}");
        // Greedy: the chosen token is the most likely one.
        let best = top.values().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert!(
            (best - token_lps[i]).abs() < 1e-6,
            "token {i}: {best} against {}",
            token_lps[i]
        );
    }
    // The first token's log-probability is the log-softmax of `kestrel logits` at the prompt's end.
    let out = std::env::temp_dir().join(format!(
        "kestrel-serve-logprobs-{}.safetensors",
        std::process::id()
    ));
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "logits",
            "--backend",
            "cpu",
            "--tokens",
            "1,562,912,7,30",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    let vocab = t.shape()[1];
    let last: Vec<f64> = t.data()[(ids.len() - 1) * vocab * 4..]
        .chunks_exact(4)
        .map(|b| f64::from(f32::from_le_bytes(b.try_into().unwrap())))
        .collect();
    let max = last.iter().copied().fold(f64::MIN, f64::max);
    let lse = max + last.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
    assert!(
        (token_lps[0] - (max - lse)).abs() < 1e-4,
        "{} against {}",
        token_lps[0],
        max - lse
    );

    // Streamed: the same log-probabilities, one token a chunk.
    let mut streamed = body.clone();
    streamed["stream"] = true.into();
    let chunks = s.stream("/v1/completions", &streamed);
    let got_stream: Vec<f64> = chunks
        .iter()
        .filter_map(|c| {
            c["choices"].get(0)?["logprobs"]["token_logprobs"]
                .get(0)?
                .as_f64()
        })
        .collect();
    assert_eq!(got_stream, token_lps);

    // Chat: `logprobs: true` with `top_logprobs`, an entry a generated token.
    let mut chat = chat_body(QUESTIONS[0], 5);
    chat["logprobs"] = true.into();
    chat["top_logprobs"] = 3.into();
    let (status, got) = s.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{got}");
    let content = got["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        got["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(e["logprob"], top[0]["logprob"], "{e}");
        assert_eq!(
            e["bytes"].as_array().unwrap().len(),
            e["token"].as_str().unwrap().len()
        );
    }
    // Without logprobs the answer says null, and its text is the same.
    let (_, plain) = s.post("/v1/chat/completions", &chat_body(QUESTIONS[0], 5));
    assert!(plain["choices"][0]["logprobs"].is_null());
    assert_eq!(content_of(&plain), content_of(&got));
}

fn content_of(answer: &Value) -> String {
    answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn choices_sample_with_their_own_seeds_as_run_does() {
    let s = Server::start(&[]);
    let q = QUESTIONS[2];
    let mut body = chat_body(q, 12);
    body["temperature"] = 0.8.into();
    body["seed"] = 5.into();
    body["n"] = 2.into();
    let (status, got) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{got}");
    let choices = got["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, seed) in ["5", "6"].iter().enumerate() {
        let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .args([
                "run",
                "--backend",
                "cpu",
                "--json",
                "-p",
                q,
                "-n",
                "12",
                "--temp",
                "0.8",
                "--seed",
                seed,
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let want: Value =
            serde_json::from_str(String::from_utf8(o.stdout).unwrap().lines().last().unwrap()).unwrap();
        assert_eq!(choices[i]["index"], i);
        assert_eq!(
            choices[i]["message"]["content"], want["text"],
            "choice {i} (seed {seed})"
        );
    }
    assert_ne!(choices[0]["message"]["content"], choices[1]["message"]["content"]);
    // The same request again: the same answers.
    let (_, again) = s.post("/v1/chat/completions", &body);
    assert_eq!(again["choices"], got["choices"]);
}

#[test]
fn a_stop_string_ends_the_answer_before_it() {
    let s = Server::start(&[]);
    let (_, full) = s.post("/v1/chat/completions", &chat_body(QUESTIONS[0], 24));
    let text = content(&full).to_string();
    // A stop string from the middle of the greedy answer.
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 4, "{text:?}");
    let stop = words[words.len() / 2];
    let at = text.find(stop).unwrap();
    let mut body = chat_body(QUESTIONS[0], 24);
    body["stop"] = json!([stop, "never appears"]);
    let (status, got) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{got}");
    assert_eq!(content(&got), &text[..at]);
    assert_eq!(got["choices"][0]["finish_reason"], "stop");
    // Streamed, the stop string is held back and never sent.
    body["stream"] = true.into();
    let chunks = s.stream("/v1/chat/completions", &body);
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, &text[..at]);
}

#[test]
fn bench_serve_measures_a_running_server_by_its_url() {
    let s = Server::start(&["--api-key", "k"]);
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "bench",
            "serve",
            "--url",
            &s.base,
            "--api-key",
            "k",
            "-c",
            "2",
            "-n",
            "3",
        ])
        .args(["--prompt-len", "5", "--output-len", "4", "--json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let v: Value =
        serde_json::from_str(String::from_utf8(o.stdout).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!(
        (v["completed"].as_u64(), v["output_tokens"].as_u64()),
        (Some(3), Some(12)),
        "{v}"
    );
    assert_eq!(v["url"], s.base.as_str());
    // The server served them (and the warm-up): 16 tokens in its counters.
    let (_, m) = s.get("/metrics");
    assert_eq!(metric(&m, "kestrel_generation_tokens_total"), 16.0, "{m}");
    // Without the key, the run fails and says why.
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "bench",
            "serve",
            "--url",
            &s.base,
            "-n",
            "1",
            "--prompt-len",
            "5",
            "--output-len",
            "4",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("401"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A request that begins as an earlier one did finds that beginning's KV blocks in the cache
/// (`usage.prompt_tokens_details.cached_tokens`, whole blocks of 16) and answers as a server
/// that had to compute them does.
#[test]
fn a_shared_beginning_is_found_in_the_cache() {
    let system = "You are a careful assistant who answers questions about Python in one or two \
                  sentences, with a short example when one helps.";
    let body = |q: &str| {
        json!({
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "max_tokens": 12,
            "temperature": 0,
        })
    };
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let s = Server::start(&[]);
    let (_, first) = s.post("/v1/chat/completions", &body(QUESTIONS[0]));
    assert_eq!(cached(&first), 0, "{first}");
    let (status, second) = s.post("/v1/chat/completions", &body(QUESTIONS[1]));
    assert_eq!(status, 200, "{second}");
    let found = cached(&second);
    assert!(found >= 16 && found % 16 == 0, "cached tokens {found}: {second}");
    let fresh = Server::start(&[]);
    let (_, alone) = fresh.post("/v1/chat/completions", &body(QUESTIONS[1]));
    assert_eq!(cached(&alone), 0);
    assert_eq!(content(&second), content(&alone));
}
