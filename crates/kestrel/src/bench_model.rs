//! `kestrel bench` on a model (llama-bench style): prompt processing (`pp`, a prompt of `-p`
//! tokens prefilled from an empty context) and token generation (`tg`, `-n` tokens decoded one
//! at a time from an empty context, each a graph replay whose only host synchronisation is the
//! read-back of the chosen token id), in tokens per second, median of `-r` runs after a warm-up.
//! The model is a directory, or a named real configuration with random weights built in memory
//! (`--synthetic NAME [--layers N]`). Times are wall-clock around each whole test, as a user
//! sees them; on CUDA the generation figure is set beside its floor, the bytes a decode step
//! reads over the device's copy bandwidth (`Device::ceilings`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use kestrel_core::rng::Rng;
use kestrel_core::Config;
use kestrel_cuda::{Device, RunMode};
use kestrel_engine::{Engine, EngineOptions, Model, ModelSource, Want};
use kestrel_model::{footprint, SYNTHETIC_MODELS};

use crate::args::{BackendArgs, MemoryArgs, QuantArgs, SyntheticArgs};
use crate::stats::median;

#[derive(Args)]
pub struct ModelBenchArgs {
    /// Model directory (config.json and safetensors weights).
    #[arg(short = 'm', long, conflicts_with = "synthetic")]
    model: Option<PathBuf>,
    #[command(flatten)]
    synthetic: SyntheticArgs,
    /// Prompt lengths of the prompt-processing tests, comma separated (0: none).
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "512")]
    n_prompt: Vec<usize>,
    /// Token counts of the generation tests, comma separated (0: none).
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "128")]
    n_gen: Vec<usize>,
    /// Tokens already in the context when each test starts (llama-bench's depth): a random
    /// prompt of this many tokens is prefilled, untimed, before every run.
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Timed runs of each test (the median is reported).
    #[arg(short = 'r', long, default_value_t = 5)]
    reps: usize,
    /// Sequences decoded at once by the generation tests, comma separated: each count above 1
    /// adds tests (`tg128 x64`) that run the next token of that many sequences as one batched
    /// step, each after its own `-d` tokens, reporting the tokens of all of them per second.
    #[arg(short = 'b', long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Also decode one sequence through the batched steps (`tg128 x1`): the program `run`,
    /// `chat` and `serve` decode with (a block table and a sequence per token; greedy here, where
    /// they draw each row), where `tg128` runs the one-sequence program.
    #[arg(long)]
    batched_one: bool,
    /// Prefill in chunks of at most this many tokens (default: the whole prompt at once).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// The batched generation tests' steps also run this many prompt tokens of more sequences
    /// (a server's steps while prompts come in: `tg32 x64 +512`); 0: none.
    #[arg(long, default_value_t = 0)]
    mixed: usize,
    /// The `--mixed` prompt tokens are those of this many sequences, in equal chunks (several
    /// prompts' chunks a step, their attention in runs of 16 tokens: `tg32 x64 +2048/4`).
    #[arg(long, default_value_t = 1, value_parser = crate::args::at_least_one)]
    mixed_prompts: usize,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    quant: QuantArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    /// What each generation step is fed: the token the previous one chose (greedy; random
    /// weights soon repeat themselves, so the same experts come back), or a fresh random token
    /// (routing spread as over real text, the harder case for streamed experts).
    #[arg(long, value_enum, default_value_t = TgInput::Greedy)]
    tg_input: TgInput,
    /// Seed of the synthetic weights and of the benchmark's token ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// On CUDA, also run the longest prompt test, one generation test and the largest batched
    /// one eagerly with every dispatch timed, and print their per-kernel tables (to stderr).
    #[arg(long)]
    profile: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// What generation steps are fed (`--tg-input`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TgInput {
    Greedy,
    Random,
}

/// One test's result.
struct TestRow {
    name: String,
    n_prompt: usize,
    n_gen: usize,
    /// Sequences generating at once (each `n_gen` tokens).
    batch: usize,
    samples: Vec<f64>,
    /// When experts stream, the bytes each generation run copied into the caches per token
    /// (runs differ: each is fed its own tokens, and the caches carry over between runs).
    copied: Vec<f64>,
}

impl TestRow {
    fn tokens(&self) -> usize {
        self.n_prompt + self.n_gen * self.batch
    }

    fn median_tps(&self) -> f64 {
        median(self.samples.iter().map(|s| self.tokens() as f64 / s).collect())
    }
}

/// Random token ids of the vocabulary.
fn ids(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.range(0, vocab) as u32).collect()
}

/// A test's name, with llama-bench's ` @ dN` when it runs after `depth` held tokens.
fn at_depth(name: String, depth: usize) -> String {
    if depth > 0 {
        format!("{name} @ d{depth}")
    } else {
        name
    }
}

/// Starts a new sequence holding `depth` random tokens (prefilled, the caller does not time
/// it): the context a test runs in.
fn start_at(e: &mut Engine, rng: &mut Rng, depth: usize) -> Result<()> {
    e.reset()?;
    if depth > 0 {
        let vocab = e.config().vocab;
        e.step(&ids(rng, vocab, depth), 0, Want::Argmax)?;
    }
    Ok(())
}

/// Decodes `n` tokens after `depth` held ones starting with `first`, each step fed the token
/// the last one chose or, with `random`, a random one; returns the last id chosen.
fn generate(e: &mut Engine, first: u32, depth: usize, n: usize, random: Option<&mut Rng>) -> Result<u32> {
    let vocab = e.config().vocab;
    let (mut t, mut chosen, mut random) = (first, first, random);
    for at in depth..depth + n {
        chosen = e
            .step(&[t], at, Want::Argmax)?
            .token()
            .context("the step returned no token")?;
        t = match random.as_deref_mut() {
            Some(rng) => rng.range(0, vocab) as u32,
            None => chosen,
        };
    }
    Ok(chosen)
}

/// The generator of `--tg-input random`'s tokens for one generation run (None: greedy).
fn tg_tokens(input: TgInput, rng: &mut Rng) -> Option<Rng> {
    (input == TgInput::Random).then(|| Rng::new(rng.next_u64()))
}

/// Runs every test on `e`.
fn run_tests(e: &mut Engine, a: &ModelBenchArgs, rng: &mut Rng) -> Result<Vec<TestRow>> {
    let vocab = e.config().vocab;
    let mut rows = Vec::new();
    for &pp in a.n_prompt.iter().filter(|&&n| n > 0) {
        let prompt = ids(rng, vocab, pp);
        // Warm-up: uploads the weights on the first test and prepares the programs.
        start_at(e, rng, a.depth)?;
        e.step(&prompt, a.depth, Want::Argmax)?;
        let mut samples = Vec::with_capacity(a.reps);
        for _ in 0..a.reps {
            let prompt = ids(rng, vocab, pp);
            // Each run is a new sequence (the hybrids' states start from zero).
            start_at(e, rng, a.depth)?;
            let start = Instant::now();
            e.step(&prompt, a.depth, Want::Argmax)?;
            samples.push(start.elapsed().as_secs_f64());
        }
        rows.push(TestRow {
            name: at_depth(format!("pp{pp}"), a.depth),
            n_prompt: pp,
            n_gen: 0,
            batch: 1,
            samples,
            copied: Vec::new(),
        });
    }
    for &tg in a.n_gen.iter().filter(|&&n| n > 0) {
        start_at(e, rng, a.depth)?;
        generate(
            e,
            ids(rng, vocab, 1)[0],
            a.depth,
            tg.min(4),
            tg_tokens(a.tg_input, rng).as_mut(),
        )?;
        let (mut samples, mut copied) = (Vec::with_capacity(a.reps), Vec::new());
        for _ in 0..a.reps {
            let first = ids(rng, vocab, 1)[0];
            start_at(e, rng, a.depth)?;
            let mut tokens = tg_tokens(a.tg_input, rng);
            let before = e.expert_stats()?;
            let start = Instant::now();
            generate(e, first, a.depth, tg, tokens.as_mut())?;
            samples.push(start.elapsed().as_secs_f64());
            if let (Some(b), Some(after)) = (before, e.expert_stats()?) {
                copied.push((after.bytes_copied - b.bytes_copied) as f64 / tg as f64);
            }
        }
        rows.push(TestRow {
            name: at_depth(format!("tg{tg}"), a.depth),
            n_prompt: 0,
            n_gen: tg,
            batch: 1,
            samples,
            copied,
        });
    }
    Ok(rows)
}

/// One timed run of a batched generation test: `b` sequences started afresh, each holding
/// `depth` random tokens (untimed), then `n` batched steps of every sequence's next token, each
/// step with `mixed.0` random prompt tokens beside them at positions from 0, of sequence `b`
/// or of `mixed.1` sequences from `b` on in equal chunks (new prompts' chunks, as a server's
/// steps take them); the seconds of the steps.
fn batched_run(
    e: &mut Engine,
    (b, depth, n, mixed): (usize, usize, usize, (usize, usize)),
    input: TgInput,
    rng: &mut Rng,
) -> Result<f64> {
    let vocab = e.config().vocab;
    for s in 0..b {
        e.select_seq(s, true)?;
        if depth > 0 {
            e.step(&ids(rng, vocab, depth), 0, Want::Argmax)?;
        }
    }
    let (tokens, prompts) = mixed;
    let per = tokens.div_ceil(prompts.max(1)).max(1);
    let mut seqs: Vec<u32> = (0..b as u32).collect();
    seqs.extend((0..tokens).map(|t| (b + t / per) as u32));
    let chunk = ids(rng, vocab, tokens);
    let mut fed = ids(rng, vocab, b);
    let start = Instant::now();
    for i in 0..n {
        let mut at = vec![(depth + i) as u32; b];
        at.extend((0..tokens).map(|t| (t % per) as u32));
        fed.extend_from_slice(&chunk);
        let chosen = e
            .step_mixed(&seqs, &fed, &at, b, Want::Argmax)?
            .into_tokens()
            .context("the batched step returned no tokens")?;
        fed = match input {
            TgInput::Random => ids(rng, vocab, b),
            TgInput::Greedy => chosen,
        };
    }
    Ok(start.elapsed().as_secs_f64())
}

/// A batched test's name: `tg32 x64`, with the prompt tokens beside each step `tg32 x64 +512`.
fn batched_name(tg: usize, b: usize, mixed: (usize, usize)) -> String {
    match mixed {
        (0, _) => format!("tg{tg} x{b}"),
        (m, 1) => format!("tg{tg} x{b} +{m}"),
        (m, p) => format!("tg{tg} x{b} +{m}/{p}"),
    }
}

/// The sequence counts of the batched generation tests: 1 with `--batched-one`, then the `-b`
/// counts above 1.
fn batched_counts(a: &ModelBenchArgs) -> impl Iterator<Item = usize> + '_ {
    let one = a.batched_one.then_some(1);
    one.into_iter().chain(a.batch.iter().copied().filter(|&b| b > 1))
}

/// The batched generation tests ([`batched_counts`]), after a warm-up run each.
fn run_batched(e: &mut Engine, a: &ModelBenchArgs, rng: &mut Rng) -> Result<Vec<TestRow>> {
    let mut rows = Vec::new();
    for b in batched_counts(a) {
        for &tg in a.n_gen.iter().filter(|&&n| n > 0) {
            let mixed = (a.mixed, a.mixed_prompts);
            batched_run(e, (b, a.depth, tg.min(4), mixed), a.tg_input, rng)?;
            let samples = (0..a.reps)
                .map(|_| batched_run(e, (b, a.depth, tg, mixed), a.tg_input, rng))
                .collect::<Result<Vec<f64>>>()?;
            rows.push(TestRow {
                name: at_depth(batched_name(tg, b, mixed), a.depth),
                n_prompt: 0,
                n_gen: tg,
                batch: b,
                samples,
                copied: Vec::new(),
            });
        }
    }
    Ok(rows)
}

/// Bytes of the weight files read by one measurement of the disk's bandwidth.
const DISK_PROBE_BYTES: u64 = 4 << 30;

/// One measurement of the disk's read bandwidth when experts stream from the weight files
/// (the best of three rounds of parallel reads; see `ExpertReader::disk_bandwidth`), the
/// `n`-th: each reads other bytes of the files. None otherwise.
fn disk_probe(e: &mut Engine, n: u64, when: &str) -> Result<Option<serde_json::Value>> {
    // Files too small for a round of 4 MiB reads measure nothing.
    let Some((bytes, secs)) = e
        .measure_disk(DISK_PROBE_BYTES, n * DISK_PROBE_BYTES)?
        .filter(|&(b, s)| b > 0 && s > 0.0)
    else {
        return Ok(None);
    };
    let direct = e.disk_stats().is_some_and(|(_, direct)| direct);
    errln!(
        "disk{when}: {:.2} GB/s, the best of three rounds of parallel {} reads of the weight \
         files ({:.2} GiB in it)",
        bytes as f64 / secs / 1e9,
        if direct { "direct" } else { "buffered" },
        bytes as f64 / (1u64 << 30) as f64,
    );
    Ok(Some(serde_json::json!({
        "bytes": bytes,
        "seconds": secs,
        "bytes_per_s": bytes as f64 / secs,
        "direct": direct,
    })))
}

/// The disk's read bandwidth beside the run whose reads `expert_extras` counts: measured just
/// before it and, when given, just after it (a virtual disk's speed drifts over minutes of
/// reading, so one measurement at the start of `bench` can be far from what the disk gave the
/// run). `bytes_per_s`, the mean of the two, is the bound the run's reads are set against.
/// Null when experts do not stream from files.
fn disk_beside(before: Option<serde_json::Value>, after: Option<serde_json::Value>) -> serde_json::Value {
    let Some(before) = before else {
        return serde_json::Value::Null;
    };
    let rates: Vec<f64> = [Some(&before), after.as_ref()]
        .into_iter()
        .flatten()
        .filter_map(|p| p["bytes_per_s"].as_f64())
        .collect();
    serde_json::json!({
        "bytes_per_s": rates.iter().sum::<f64>() / rates.len().max(1) as f64,
        "direct": before["direct"],
        "before": before,
        "after": after,
    })
}

/// When experts stream: what the cache did over one more generation run from an empty
/// context (hit rate, misses and bytes copied per token; of those, the bytes read from the
/// weight files and the seconds spent reading them, and the seconds the host spent bringing
/// experts in); null otherwise.
fn expert_extras(
    e: &mut Engine,
    (depth, tg): (usize, usize),
    input: TgInput,
    rng: &mut Rng,
) -> Result<serde_json::Value> {
    let Some(before) = e.expert_stats()? else {
        return Ok(serde_json::Value::Null);
    };
    let (disk_before, host_before) = (e.disk_stats().map(|d| d.0).unwrap_or_default(), e.host_seconds());
    let first = ids(rng, e.config().vocab, 1)[0];
    start_at(e, rng, depth)?;
    let start = Instant::now();
    generate(e, first, depth, tg, tg_tokens(input, rng).as_mut())?;
    let secs = start.elapsed().as_secs_f64();
    let after = e.expert_stats()?.context("the cache went away")?;
    let disk = e.disk_stats().map(|d| d.0).unwrap_or_default();
    let (lookups, hits) = (after.lookups - before.lookups, after.hits - before.hits);
    let per = |n: u64| n as f64 / tg as f64;
    Ok(serde_json::json!({
        "slots": e.placement().map(|p| p.gpu_experts),
        "slots_per_layer": e.placement().map(|p| p.slots_per_layer),
        "tokens_per_s": tg as f64 / secs,
        "hit_rate": hits as f64 / lookups.max(1) as f64,
        "misses_per_token": per(after.misses - before.misses),
        "bytes_copied_per_token": per(after.bytes_copied - before.bytes_copied),
        "disk_bytes_per_token": per(disk.bytes - disk_before.bytes),
        "disk_read_s_per_token": (disk.seconds - disk_before.seconds) / tg as f64,
        "host_s_per_token": (e.host_seconds() - host_before) / tg as f64,
    }))
}

/// On CUDA: host synchronisations, graph launches and bytes read back per generated token,
/// counted over one more generation run; and with `profile`, the per-kernel tables of an eager
/// run, and of an eager batched run of `batch` sequences (the largest batched test's). Null on
/// the CPU.
fn cuda_extras(
    e: &mut Engine,
    (depth, tg, batch, mixed): (usize, usize, Option<usize>, (usize, usize)),
    (profile, input): (bool, TgInput),
    rng: &mut Rng,
) -> Result<serde_json::Value> {
    let Some(dev) = e.device().cloned() else {
        return Ok(serde_json::Value::Null);
    };
    let first = ids(rng, e.config().vocab, 1)[0];
    start_at(e, rng, depth)?;
    dev.synchronize()?;
    let before = dev.counters();
    generate(e, first, depth, tg, tg_tokens(input, rng).as_mut())?;
    let d = dev.counters() - before;
    let per = |n: u64| n as f64 / tg as f64;
    let counters = serde_json::json!({
        "host_syncs_per_token": per(d.host_syncs),
        "graph_launches_per_token": per(d.graph_launches),
        "dispatches_per_token": per(d.dispatches),
        "bytes_d2h_per_token": per(d.bytes_d2h),
    });
    if profile {
        let label = format!("tg{tg}");
        profiled(e, &dev, (&label, tg, 1), |e, n| {
            start_at(e, rng, depth)?;
            generate(e, first, depth, n, tg_tokens(input, rng).as_mut()).map(drop)
        })?;
        if let Some(b) = batch {
            let label = batched_name(tg, b, mixed);
            profiled(e, &dev, (&label, tg, b), |e, n| {
                batched_run(e, (b, depth, n, mixed), input, rng).map(drop)
            })?;
        }
    }
    Ok(counters)
}

/// Runs `run(e, n)` (which takes `n` steps of `per_step` tokens each) for `steps` steps eagerly,
/// every dispatch timed by CUDA events, after an untimed run of a few steps, and prints the
/// per-kernel table.
fn profiled(
    e: &mut Engine,
    dev: &Device,
    (label, steps, per_step): (&str, usize, usize),
    mut run: impl FnMut(&mut Engine, usize) -> Result<()>,
) -> Result<()> {
    let set_mode = |e: &mut Engine, mode| {
        if let Some(s) = e.cuda_session() {
            s.backend.set_mode(mode);
        }
    };
    set_mode(e, RunMode::Eager);
    let tokens = steps * per_step;
    let outcome = run(e, steps.min(4)).and_then(|()| {
        dev.take_profile()?;
        dev.set_profiling(true);
        let start = Instant::now();
        let outcome = run(e, steps);
        dev.set_profiling(false);
        outcome.map(|()| start.elapsed().as_secs_f64())
    });
    set_mode(e, RunMode::Graph);
    let secs = outcome?;
    errln!(
        "profile: {label} run eagerly, every dispatch timed with CUDA events ({:.1} tokens/s \
         with the timing's own cost); totals over its {tokens} tokens:\n{}",
        tokens as f64 / secs,
        dev.take_profile()?.table()
    );
    Ok(())
}

/// The model to measure.
fn source(a: &ModelBenchArgs) -> Result<ModelSource> {
    match (&a.model, a.synthetic.source(a.quant.format()?, a.seed)?) {
        (Some(dir), None) => Ok(ModelSource::Dir(dir.clone())),
        (None, Some(synthetic)) => Ok(synthetic),
        _ => bail!(
            "give a model: --model DIR or --synthetic NAME ({})",
            SYNTHETIC_MODELS.join(", ")
        ),
    }
}

pub fn run(config: &Config, a: ModelBenchArgs) -> Result<std::process::ExitCode> {
    ensure!(a.reps >= 1, "-r must be at least 1");
    ensure!(!a.batch.contains(&0), "-b counts must be at least 1");
    ensure!(a.prefill_chunk != Some(0), "--prefill-chunk must be at least 1");
    let source = source(&a)?;
    let start = Instant::now();
    let model = Model::open(&source).context("opening the model")?;
    if let ModelSource::Synthetic { name, .. } = &source {
        errln!(
            "built {name} ({} layers, {}-bit) in memory in {:.1} s",
            model.config.layers,
            a.synthetic.bits,
            start.elapsed().as_secs_f64()
        );
    }
    let label = model.label.clone();
    let fp = footprint(&model.config, &model.weights)?;
    let ctx = a
        .n_prompt
        .iter()
        .chain(&a.n_gen)
        .copied()
        .max()
        .unwrap_or(0)
        .max(1)
        .max(a.mixed)
        .saturating_add(a.depth);
    let mut rng = Rng::new(a.seed ^ 0xBE7C);
    let mut opts = EngineOptions::with_ctx(ctx);
    a.backend.apply(&mut opts);
    opts.quant = a.quant.format()?;
    opts.prefill_chunk = a.prefill_chunk;
    opts.progress = Some(Box::new(crate::progress::loading(&label)));
    let start = Instant::now();
    a.memory.apply(&mut opts);
    // The batched tests' sequences, and those whose prompt tokens run beside them.
    let most = batched_counts(&a).max();
    opts.max_seqs = most.map(|b| b + a.mixed.min(a.mixed_prompts));
    let mut engine = Engine::new(model, config, opts).with_context(|| format!("opening {label}"))?;
    crate::progress::placement(&engine);
    let backend = engine.backend();
    let mut rows = run_tests(&mut engine, &a, &mut rng)?;
    rows.extend(run_batched(&mut engine, &a, &mut rng)?);
    let tg = a.n_gen.iter().copied().max().unwrap_or(0);
    let (experts, disk) = if tg > 0 {
        let before = disk_probe(&mut engine, 0, " before the counted run")?;
        let experts = expert_extras(&mut engine, (a.depth, tg), a.tg_input, &mut rng)?;
        let after = match before {
            Some(_) => disk_probe(&mut engine, 1, " after the counted run")?,
            None => None,
        };
        (experts, disk_beside(before, after))
    } else {
        (
            serde_json::Value::Null,
            disk_beside(disk_probe(&mut engine, 0, "")?, None),
        )
    };
    if let (true, Some(&pp), Some(dev)) = (a.profile, a.n_prompt.iter().max(), engine.device().cloned()) {
        if pp > 0 {
            let vocab = engine.config().vocab;
            profiled(&mut engine, &dev, (&format!("pp{pp}"), 1, pp), |e, n| {
                for _ in 0..n {
                    let prompt = ids(&mut rng, vocab, pp);
                    start_at(e, &mut rng, a.depth)?;
                    e.step(&prompt, a.depth, Want::Argmax)?;
                }
                Ok(())
            })?;
        }
    }
    let counters = if tg > 0 {
        cuda_extras(
            &mut engine,
            (a.depth, tg, most, (a.mixed, a.mixed_prompts)),
            (a.profile, a.tg_input),
            &mut rng,
        )?
    } else {
        serde_json::Value::Null
    };
    let total_s = start.elapsed().as_secs_f64();
    crate::progress::host_tier_warning(&engine);
    // The floor of a decode step, on CUDA: the bytes it reads over the device's copy bandwidth.
    let ceilings = engine.device().map(|d| d.ceilings()).transpose()?;
    let floor_tps = ceilings.map(|c| c.copy_bytes_per_s / fp.active_bytes.max(1) as f64);
    let backend_name = backend.name();
    if a.json {
        let tests: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let tps: Vec<f64> = r.samples.iter().map(|s| r.tokens() as f64 / s).collect();
                let mut v = serde_json::json!({
                    "test": r.name,
                    "n_prompt": r.n_prompt,
                    "n_gen": r.n_gen,
                    "n_batch": r.batch,
                    "n_depth": a.depth,
                    "tokens_per_s": r.median_tps(),
                    "samples_tokens_per_s": tps,
                });
                if let (true, Some(floor)) = (r.n_gen > 0 && r.batch == 1, floor_tps) {
                    v["of_floor"] = (r.median_tps() / floor).into();
                }
                if !r.copied.is_empty() {
                    v["samples_bytes_copied_per_token"] = r.copied.clone().into();
                }
                v
            })
            .collect();
        let v = serde_json::json!({
            "model": label,
            "backend": backend_name,
            "precision": format!("{:?}", a.backend.precision).to_lowercase(),
            "reps": a.reps,
            "parameters": fp.params,
            "active_parameters_per_token": fp.active_params,
            "weight_bytes": fp.bytes,
            "active_bytes_per_token": fp.active_bytes,
            "floor_tokens_per_s": floor_tps,
            "results": tests,
            "cuda_counters": counters,
            "expert_cache": experts,
            "disk": disk,
            "wall_s": total_s,
        });
        outln!("{v}")?;
        return Ok(std::process::ExitCode::SUCCESS);
    }
    outln!(
        "model: {label} | {:.2} GiB | {:.2} B params, {:.2} B active | {backend_name}{} | median of {} runs",
        fp.bytes as f64 / (1u64 << 30) as f64,
        fp.params as f64 / 1e9,
        fp.active_params as f64 / 1e9,
        if a.backend.precision == crate::args::PrecisionFlag::Exact {
            " (exact)"
        } else {
            ""
        },
        a.reps
    )?;
    if let (Some(c), Some(floor)) = (ceilings, floor_tps) {
        outln!(
            "decode floor: {:.1} MiB read per token / {:.2} TB/s ({}) = {floor:.0} tokens/s",
            fp.active_bytes as f64 / (1u64 << 20) as f64,
            c.copy_bytes_per_s / 1e12,
            c.source
        )?;
    }
    outln!(
        "{:<10} {:>12} {:>12} {:>12} {:>9}",
        "test",
        "t/s",
        "min t/s",
        "max t/s",
        "floor"
    )?;
    for r in &rows {
        let tps: Vec<f64> = r.samples.iter().map(|s| r.tokens() as f64 / s).collect();
        let (lo, hi) = tps
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let floor = if let (true, Some(floor)) = (r.n_gen > 0 && r.batch == 1, floor_tps) {
            format!("{:.1}%", 100.0 * r.median_tps() / floor)
        } else {
            String::new()
        };
        outln!(
            "{:<10} {:>12.1} {:>12.1} {:>12.1} {:>9}",
            r.name,
            r.median_tps(),
            lo,
            hi,
            floor
        )?;
    }
    if !counters.is_null() {
        outln!("per generated token: {counters}")?;
    }
    if !experts.is_null() {
        outln!("expert cache, one tg{tg} run: {experts}")?;
    }
    if !disk.is_null() {
        outln!("disk read bandwidth, measured beside that run: {disk}")?;
    }
    Ok(std::process::ExitCode::SUCCESS)
}
