//! What `/metrics` reports, in the Prometheus text format: requests running and waiting, the
//! KV cache's use, token counters, histograms of time to first token, inter-token latency
//! and request latency, and where the engine's time went (its steps with and without prompt
//! tokens, and the programs it prepared).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kestrel_engine::StepTimes;

/// Upper bounds (seconds) of the latency histograms' buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0,
];
const E2E_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// A cumulative histogram.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Debug)]
struct Latencies {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

/// The server's counters, shared by the handlers and the engine's thread.
#[derive(Debug)]
pub struct Metrics {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    /// KV cache positions in use, and in all.
    pub kv_used: AtomicU64,
    pub kv_total: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub requests_ok: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    latencies: Mutex<Latencies>,
    steps: Mutex<StepTimes>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_used: AtomicU64::new(0),
            kv_total: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            requests_ok: AtomicU64::new(0),
            requests_failed: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            latencies: Mutex::new(Latencies {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
            }),
            steps: Mutex::new(StepTimes::default()),
        }
    }
}

impl Metrics {
    fn latencies(&self) -> std::sync::MutexGuard<'_, Latencies> {
        self.latencies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn time_to_first_token(&self, s: f64) {
        self.latencies().ttft.observe(s);
    }

    pub fn inter_token(&self, s: f64) {
        self.latencies().itl.observe(s);
    }

    pub fn request_latency(&self, s: f64) {
        self.latencies().e2e.observe(s);
    }

    /// The engine's step counts and times as they stand now.
    pub fn set_steps(&self, t: StepTimes) {
        *self
            .steps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = t;
    }

    /// The Prometheus text exposition of everything, metric names prefixed `kestrel_`.
    pub fn render(&self, model: &str) -> String {
        let model = &model
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        let mut out = String::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model=\"{model}\"}} {v}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{model=\"{model}\"}} {v}"
            );
        };
        gauge(
            &mut out,
            "kestrel_requests_running",
            "Requests being generated.",
            get(&self.running) as f64,
        );
        gauge(
            &mut out,
            "kestrel_requests_waiting",
            "Requests queued for the engine.",
            get(&self.waiting) as f64,
        );
        let total = get(&self.kv_total).max(1) as f64;
        gauge(
            &mut out,
            "kestrel_kv_cache_usage_ratio",
            "Share of the KV cache's positions in use (0 to 1).",
            get(&self.kv_used) as f64 / total,
        );
        counter(
            &mut out,
            "kestrel_prompt_tokens_total",
            "Prompt tokens prefilled or reused.",
            get(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "kestrel_generation_tokens_total",
            "Tokens generated.",
            get(&self.generation_tokens),
        );
        let _ = writeln!(
            out,
            "# HELP kestrel_requests_total Requests finished, by outcome.\n# TYPE kestrel_requests_total counter"
        );
        for (outcome, v) in [
            ("ok", &self.requests_ok),
            ("error", &self.requests_failed),
            ("cancelled", &self.requests_cancelled),
        ] {
            let _ = writeln!(
                out,
                "kestrel_requests_total{{model=\"{model}\",outcome=\"{outcome}\"}} {}",
                get(v)
            );
        }
        let t = *self
            .steps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Counters by the steps' kind.
        let by_kind = |out: &mut String, name: &str, help: &str, prompt: f64, decode: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (kind, v) in [("prompt", prompt), ("decode", decode)] {
                let _ = writeln!(out, "{name}{{model=\"{model}\",kind=\"{kind}\"}} {v}");
            }
        };
        by_kind(
            &mut out,
            "kestrel_engine_steps_total",
            "Engine steps: with prompt tokens (a chunk of a prompt, with or without decoding \
             sequences beside it), or decoding only.",
            t.prompt_steps as f64,
            t.decode_steps as f64,
        );
        by_kind(
            &mut out,
            "kestrel_engine_step_seconds_total",
            "Seconds the engine spent in its steps, by kind.",
            t.prompt_seconds,
            t.decode_seconds,
        );
        by_kind(
            &mut out,
            "kestrel_engine_step_tokens_total",
            "Tokens the engine's steps ran: prompt tokens, and tokens decoded.",
            t.prompt_tokens as f64,
            t.decoded_tokens as f64,
        );
        counter(
            &mut out,
            "kestrel_engine_prompt_chunks_total",
            "Prompts' chunks the engine's steps ran (a step may take several).",
            t.prompt_chunks,
        );
        counter(
            &mut out,
            "kestrel_engine_programs_prepared_total",
            "Step programs the engine prepared (built, planned and captured).",
            t.programs,
        );
        counter(
            &mut out,
            "kestrel_engine_programs_evicted_total",
            "Step programs the engine dropped to make room in device memory for another.",
            t.programs_evicted,
        );
        let _ = writeln!(
            out,
            "# HELP kestrel_engine_program_seconds_total Seconds spent preparing step programs.\n\
             # TYPE kestrel_engine_program_seconds_total counter\n\
             kestrel_engine_program_seconds_total{{model=\"{model}\"}} {}",
            t.program_seconds
        );
        let l = self.latencies();
        l.ttft.write(
            &mut out,
            "kestrel_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        );
        l.itl.write(
            &mut out,
            "kestrel_inter_token_latency_seconds",
            "Time between a request's successive tokens.",
        );
        l.e2e.write(
            &mut out,
            "kestrel_request_latency_seconds",
            "Time from a request's arrival to its last token.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let m = Metrics::default();
        for s in [0.003, 0.02, 7.0, 100.0] {
            m.time_to_first_token(s);
        }
        let text = m.render("m");
        assert!(
            text.contains("kestrel_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("kestrel_time_to_first_token_seconds_bucket{le=\"0.025\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("kestrel_time_to_first_token_seconds_bucket{le=\"10\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("kestrel_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4\n"),
            "{text}"
        );
        assert!(
            text.contains("kestrel_time_to_first_token_seconds_count 4\n"),
            "{text}"
        );
    }
}
