//! A session that streams its routed experts through small caches of slots computes exactly
//! what the resident session computes: the same logits bit for bit on the CPU backend, for every
//! fixture with experts, over a chunked prefill (chunks too long for the caches: staged) and
//! greedy decode steps (fetched into caches so small that every step evicts), with the experts
//! in host memory (served inside the graph), read from the checkpoint by the host between
//! segments, or some of each; on CUDA (graph replay, bf16 caches) the same within float
//! summation order.

mod common;

use common::{argmax, dir, reference, rel_max_err, FIXTURES};
use kestrel_core::{Backend, DType};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, RunMode};
use kestrel_model::{Eviction, ModelConfig, OwnedTensor, Session, StageAhead, Want, Weights};
use kestrel_testing::gpu::device_or_skip;

/// A prompt prefilled in chunks of 5, then 6 decode steps, the first greedy and the others
/// the prompt's tokens backwards (the tiny random models' greedy continuations repeat one
/// token, whose experts would stay cached); every logit of the way.
fn logits<B: Backend>(s: &mut Session<B>, prompt: &[u32]) -> Vec<f32> {
    let mut out = s.step(prompt, 0, Want::AllLogits).unwrap().into_logits().unwrap();
    let vocab = out.len() / prompt.len();
    let mut next = argmax(&out[out.len() - vocab..]);
    for i in 0..6 {
        let l = s
            .step(&[next], prompt.len() + i, Want::LastLogits)
            .unwrap()
            .into_logits()
            .unwrap();
        next = prompt[prompt.len() - 1 - i % prompt.len()];
        out.extend(l);
    }
    out
}

fn session(name: &str) -> Session<CpuBackend> {
    Session::open(&dir(name), CpuBackend::new(), 64, DType::F32)
        .unwrap()
        .with_prefill_chunk(Some(5))
        .unwrap()
}

#[test]
fn streamed_experts_compute_the_resident_logits() {
    let mut checked = 0;
    for name in FIXTURES {
        let c = ModelConfig::from_dir(&dir(name)).unwrap();
        let Some(moe) = c.moe.as_ref().filter(|_| c.moe_layers() > 0) else {
            continue;
        };
        let (prompt, _, _) = reference(name);
        let want = logits(&mut session(name), &prompt);
        // Host tiers of every layer, one layer (the rest read from the checkpoint) and none;
        // the smallest caches, and one slot more; whole layers staged ahead or not (chunks of 5
        // tokens take 10 experts of the fixtures' 8).
        let k = moe.experts_per_token;
        let mut staged = Vec::new();
        for (slots, policy, host_layers, ahead) in [
            (k, Eviction::Lru, usize::MAX, StageAhead::Off),
            (k, Eviction::Lru, usize::MAX, StageAhead::On),
            (k + 1, Eviction::Frequency { half_life: 4 }, 1, StageAhead::On),
            (k, Eviction::Lru, 0, StageAhead::On),
            (k, Eviction::Lru, 2, StageAhead::Auto),
        ] {
            let mut s = session(name)
                .with_expert_cache(slots, policy)
                .unwrap()
                .with_host_layers(host_layers)
                .with_stage_ahead(ahead);
            let got = logits(&mut s, &prompt);
            assert!(
                got == want,
                "{name}, {slots} slots, {policy:?}, {host_layers} host layers, {ahead:?}: logits differ"
            );
            let stats = s.expert_stats().unwrap().unwrap();
            assert!(
                stats.misses > 0 && stats.evictions > 0 && stats.staged > 0,
                "{name}: {stats:?}"
            );
            assert_eq!(stats.hits + stats.misses, stats.lookups);
            // The layers outside the host tier read their experts from the files directly.
            let read = s.disk_stats().map_or(0, |(d, _)| d.experts);
            assert_eq!(
                read > 0,
                host_layers < c.moe_layers(),
                "{name}: {read} experts read"
            );
            staged.push(stats.staged);
        }
        // Staging whole layers copies every expert of a full chunk, more than the chunk uses.
        assert!(staged[1] > staged[0], "{name}: staged {staged:?}");
        checked += 1;
    }
    assert!(checked >= 3, "fixtures with experts: {checked}");
}

#[test]
fn a_cache_smaller_than_a_tokens_experts_or_a_dense_model_is_refused() {
    let c = ModelConfig::from_dir(&dir("qwen3_moe")).unwrap();
    let k = c.moe.as_ref().unwrap().experts_per_token;
    let err = session("qwen3_moe")
        .with_expert_cache(k - 1, Eviction::Lru)
        .err()
        .unwrap();
    assert!(err.to_string().contains("experts a token takes"), "{err}");
    let err = session("qwen3")
        .with_expert_cache(64, Eviction::Lru)
        .err()
        .unwrap();
    assert!(err.to_string().contains("no routed experts"), "{err}");
}

#[test]
fn streamed_experts_compute_the_resident_logits_on_cuda() {
    let Some(dev) = device_or_skip("streamed_experts_compute_the_resident_logits_on_cuda") else {
        return;
    };
    let open = |name: &str| {
        let cuda = CudaBackend::new(dev.clone(), RunMode::Graph);
        Session::open(&dir(name), cuda, 64, DType::BF16)
            .unwrap()
            .with_prefill_chunk(Some(5))
            .unwrap()
    };
    for name in FIXTURES {
        let c = ModelConfig::from_dir(&dir(name)).unwrap();
        let Some(moe) = c.moe.as_ref().filter(|_| c.moe_layers() > 0) else {
            continue;
        };
        let (prompt, _, _) = reference(name);
        let want = logits(&mut open(name), &prompt);
        for (host_layers, ahead) in [(usize::MAX, false), (usize::MAX, true), (1, true)] {
            let mut s = open(name)
                .with_expert_cache(moe.experts_per_token, Eviction::Lru)
                .unwrap()
                .with_host_layers(host_layers)
                .with_stage_ahead(if ahead { StageAhead::On } else { StageAhead::Off });
            let got = logits(&mut s, &prompt);
            let err = rel_max_err(&got, &want);
            assert!(
                err <= 1e-5,
                "{name}, {host_layers} host layers, ahead {ahead}: streamed logits differ from resident ones by {err:e}"
            );
            let stats = s.expert_stats().unwrap().unwrap();
            assert!(stats.evictions > 0 && stats.staged > 0, "{name}: {stats:?}");
            assert_eq!(stats.hits + stats.misses, stats.lookups);
            // Past the first layer, experts are read from the files into page-locked staging.
            let read = s.disk_stats().map_or(0, |(d, _)| d.experts);
            assert_eq!(
                read > 0,
                host_layers < c.moe_layers(),
                "{name}: {read} experts read"
            );
            assert!(s.host_tier_note().is_none(), "{:?}", s.host_tier_note());
        }
    }
}

/// The CPU backend whose host memory runs out after `host_allocs` allocations, counting the
/// reads of buffers back to the host.
struct ScarceHost {
    cpu: CpuBackend,
    host_allocs: usize,
    reads: usize,
}

impl Backend for ScarceHost {
    type Program = <CpuBackend as Backend>::Program;
    type Error = <CpuBackend as Backend>::Error;
    type HostBuffer = <CpuBackend as Backend>::HostBuffer;

    fn name(&self) -> &'static str {
        "scarce-host cpu"
    }

    fn prepare(&mut self, graph: &kestrel_core::ir::Graph) -> Result<Self::Program, Self::Error> {
        self.cpu.prepare(graph)
    }

    fn graph(program: &Self::Program) -> &kestrel_core::ir::Graph {
        CpuBackend::graph(program)
    }

    fn write_bytes(
        &mut self,
        p: &mut Self::Program,
        buf: kestrel_core::ir::Buf,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), Self::Error> {
        self.cpu.write_bytes(p, buf, offset, bytes)
    }

    fn read_bytes(
        &mut self,
        p: &Self::Program,
        buf: kestrel_core::ir::Buf,
        out: &mut [u8],
    ) -> Result<(), Self::Error> {
        self.reads += 1;
        self.cpu.read_bytes(p, buf, out)
    }

    fn run(&mut self, p: &mut Self::Program) -> Result<(), Self::Error> {
        self.cpu.run(p)
    }

    fn alloc_host(&mut self, bytes: usize) -> Result<Self::HostBuffer, Self::Error> {
        if self.host_allocs == 0 {
            return Err(kestrel_core::CoreError::OutOfBounds {
                label: "host memory (this test's limit)".into(),
                offset: 0,
                len: bytes,
                capacity: 0,
            }
            .into());
        }
        self.host_allocs -= 1;
        self.cpu.alloc_host(bytes)
    }

    fn host_bytes_mut(host: &mut Self::HostBuffer) -> Result<&mut [u8], Self::Error> {
        CpuBackend::host_bytes_mut(host)
    }

    fn adopt_host(&mut self, label: &str, host: Self::HostBuffer) -> Result<(), Self::Error> {
        self.cpu.adopt_host(label, host)
    }

    fn write_from_host(
        &mut self,
        p: &mut Self::Program,
        buf: kestrel_core::ir::Buf,
        offset: usize,
        src: &Self::HostBuffer,
        range: std::ops::Range<usize>,
    ) -> Result<(), Self::Error> {
        self.cpu.write_from_host(p, buf, offset, src, range)
    }
}

#[test]
fn host_memory_running_out_falls_back_to_the_checkpoint_and_says_so() {
    let name = "qwen3_next";
    let c = ModelConfig::from_dir(&dir(name)).unwrap();
    let k = c.moe.as_ref().unwrap().experts_per_token;
    let (prompt, _, _) = reference(name);
    let want = logits(&mut session(name), &prompt);
    let scarce = ScarceHost {
        cpu: CpuBackend::new(),
        host_allocs: 1,
        reads: 0,
    };
    let mut s = Session::open(&dir(name), scarce, 64, DType::F32)
        .unwrap()
        .with_prefill_chunk(Some(5))
        .unwrap()
        .with_expert_cache(k, Eviction::Lru)
        .unwrap();
    assert!(s.host_tier_note().is_none());
    assert!(logits(&mut s, &prompt) == want, "the fallback changed the logits");
    let note = s.host_tier_note().expect("the shortfall is noted");
    assert!(
        note.contains("ran out after 1 of") && note.contains("checkpoint"),
        "{note}"
    );
    assert!(note.contains("pageable memory"), "{note}");
}

/// A session reading experts from the fixture `name` copied to a directory of its own, after a
/// chunked prefill and a decode step (so every program it will run is prepared).
fn reading_copy(name: &str, tag: &str) -> (common::TempDir, Session<CpuBackend>, Vec<u32>) {
    let d = common::TempDir::new(tag);
    for entry in std::fs::read_dir(dir(name)).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, d.0.join(path.file_name().unwrap())).unwrap();
        }
    }
    let c = ModelConfig::from_dir(&d.0).unwrap();
    let k = c.moe.as_ref().unwrap().experts_per_token;
    let mut s = Session::open(&d.0, CpuBackend::new(), 64, DType::F32)
        .unwrap()
        .with_prefill_chunk(Some(5))
        .unwrap()
        .with_expert_cache(k, Eviction::Lru)
        .unwrap()
        .with_host_layers(0);
    let (prompt, _, _) = reference(name);
    s.step(&prompt, 0, Want::LastLogits).unwrap();
    s.step(&[prompt[0]], prompt.len(), Want::LastLogits).unwrap();
    assert!(s.disk_stats().unwrap().0.experts > 0);
    (d, s, prompt)
}

/// Decode steps until one reads experts (each token takes others than the last's): the error
/// of the first that fails.
fn first_read_error(s: &mut Session<CpuBackend>, prompt: &[u32]) -> String {
    for (i, &t) in prompt.iter().enumerate() {
        if let Err(e) = s.step(&[t], prompt.len() + 1 + i, Want::LastLogits) {
            return e.to_string();
        }
    }
    panic!("no step read an expert from the changed file");
}

#[test]
fn expert_files_truncated_or_rewritten_under_a_session_are_errors() {
    for name in ["qwen3_moe", "qwen3_moe_mlx_q4"] {
        let (d, mut s, prompt) = reading_copy(name, &format!("truncated-{name}"));
        let file = d.0.join("model.safetensors");
        let len = std::fs::metadata(&file).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let msg = first_read_error(&mut s, &prompt);
        assert!(
            msg.contains("model.safetensors") && msg.contains("since the model was loaded"),
            "{name}: {msg}"
        );

        // The same length, other bytes.
        let (d, mut s, prompt) = reading_copy(name, &format!("rewritten-{name}"));
        let file = d.0.join("model.safetensors");
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut bytes = std::fs::read(&file).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 1;
        std::fs::write(&file, bytes).unwrap();
        let msg = first_read_error(&mut s, &prompt);
        assert!(msg.contains("was modified"), "{name}: {msg}");
    }
}

#[test]
fn experts_held_in_memory_are_dropped_once_the_host_tier_has_them() {
    let name = "qwen3_moe_mlx_q4";
    let c = ModelConfig::from_dir(&dir(name)).unwrap();
    let k = c.moe.as_ref().unwrap().experts_per_token;
    let (prompt, _, _) = reference(name);
    let want = logits(&mut session(name), &prompt);
    // The fixture's tensors held in memory, as a synthetic model's are.
    let mapped = Weights::open(&dir(name)).unwrap();
    let owned = mapped
        .names()
        .into_iter()
        .map(|n| {
            let t = mapped.get(n).unwrap();
            OwnedTensor {
                name: n.to_string(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                bytes: t.bytes.to_vec().into(),
            }
        })
        .collect();
    let w = Weights::from_memory("in memory", owned).unwrap();
    let mut s = Session::new(c.clone(), w, CpuBackend::new(), 64, DType::F32)
        .with_prefill_chunk(Some(5))
        .unwrap()
        .with_expert_cache(k, Eviction::Lru)
        .unwrap();
    assert!(logits(&mut s, &prompt) == want, "logits differ");
    let expert = "model.layers.0.mlp.switch_mlp.gate_proj.weight";
    let err = s.weights.get(expert).unwrap_err().to_string();
    assert!(err.contains("dropped from memory"), "{err}");
    // Mapped files are left as they are.
    let mut mapped = mapped;
    assert!(!mapped.release(expert));
    assert!(mapped.get(expert).is_ok());
}

#[test]
fn a_streamed_decode_step_reads_back_only_its_token() {
    // Every layer served by the graph (from host memory), whole layers staged ahead when the
    // prefill decides so: a decode step then reads back its token and nothing else, as a
    // resident one does (on CUDA: one host synchronisation a token).
    let name = "qwen3_next";
    let c = ModelConfig::from_dir(&dir(name)).unwrap();
    let k = c.moe.as_ref().unwrap().experts_per_token;
    let (prompt, _, _) = reference(name);
    let counting = ScarceHost {
        cpu: CpuBackend::new(),
        host_allocs: usize::MAX,
        reads: 0,
    };
    let mut s = Session::open(&dir(name), counting, 64, DType::F32)
        .unwrap()
        .with_prefill_chunk(Some(5))
        .unwrap()
        .with_expert_cache(k, Eviction::Lru)
        .unwrap()
        .with_stage_ahead(StageAhead::Auto);
    let mut next = s.step(&prompt, 0, Want::Argmax).unwrap().token().unwrap();
    let before = s.backend.reads;
    for i in 0..4 {
        next = s
            .step(&[next], prompt.len() + i, Want::Argmax)
            .unwrap()
            .token()
            .unwrap();
    }
    assert_eq!(s.backend.reads - before, 4, "reads back in 4 decode steps");
}
