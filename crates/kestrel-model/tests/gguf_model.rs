//! GGUF files as models (`open_gguf`), against the Hugging Face directories they were converted
//! from by llama.cpp's own converter (`tests/gguf/NAME-TYPE.gguf`, made by
//! `scripts/gguf/make-model-fixtures.py` from `tests/parity/NAME`): the configuration read from
//! metadata equals the directory's `config.json`; every tensor the graph reads is the
//! directory's tensor with the converter's changes undone, within the file type's rounding; and
//! on the CPU the logits match transformers' reference within that rounding (bf16: the
//! directory's own logits, bit for bit).

mod common;

use common::{reference, rel_max_err, top1_agreement, top1_agreement_or_tie};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{open_gguf, ModelConfig, Session, Want, Weights};

fn gguf(name: &str, ty: &str) -> std::path::PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf").join(format!("{name}-{ty}.gguf"))
}

const CASES: [(&str, &str); 10] = [
    ("llama", "f16"),
    ("llama", "q8_0"),
    ("qwen3", "bf16"),
    ("qwen3_moe_all", "bf16"),
    ("qwen3_moe_all", "f16"),
    ("qwen3_moe_all", "q8_0"),
    ("qwen3_next", "f16"),
    ("qwen3_next", "q8_0"),
    ("qwen3_5_moe", "f16"),
    ("qwen3_5_moe", "q8_0"),
];

fn values(w: &Weights, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = w.get(name).unwrap();
    let v = match t.dtype {
        DType::F32 => t
            .bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F16 => t
            .bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::BF16 => t
            .bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        d => panic!("{name}: {d}"),
    };
    let shape = t.shape.iter().copied().filter(|&d| d != 1).collect();
    (shape, v)
}

/// The logits of every position of `tokens` in one prefill of `m` on the CPU (f32 caches).
fn cpu_logits(m: kestrel_model::GgufModel, tokens: &[u32]) -> Vec<f32> {
    Session::new(m.config, m.weights, CpuBackend::new(), 128, DType::F32)
        .step(tokens, 0, Want::AllLogits)
        .unwrap()
        .into_logits()
        .unwrap()
}

/// The largest difference between `got` and `want` allowed by the file type: none for bf16
/// (the directory's own values); f16 rounds bf16 values below its normal range; Q8_0 rounds
/// each block of 32 to steps of 1/127 of its largest value: half a step, and the step itself
/// rounded to f16 (up to 127 times 2^-11 of a step more).
fn allowed(ty: &str, want: &[f32]) -> f32 {
    let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    match ty {
        "bf16" => 0.0,
        "f16" => 6.0e-8,
        _ => max / 127.0 * (0.5 + 127.0 / 2048.0),
    }
}

#[test]
fn the_config_read_from_metadata_is_the_directorys() {
    for (name, ty) in CASES {
        let m = open_gguf(&gguf(name, ty)).unwrap_or_else(|e| panic!("{name}-{ty}: {e}"));
        let mut want = ModelConfig::from_dir(&common::dir(name)).unwrap();
        let mut got = m.config.clone();
        // What a GGUF file does not carry or holds differently: the checkpoint's dtype, the
        // multimodal nesting, the epsilon as an f32, Llama 3's rope parameters as factors.
        want.dtype = None;
        want.nested_text = false;
        assert_eq!(got.norm_eps as f32, want.norm_eps as f32, "{name}-{ty}");
        got.norm_eps = want.norm_eps;
        if let kestrel_core::rope::RopeScaling::Factors(f) = &got.rope.scaling {
            let table =
                |s| kestrel_core::rope::RopeTable::new(want.rope.theta, want.head_dim, 1.0, s).inv_freq;
            let (a, b) = (table(&got.rope.scaling), table(&want.rope.scaling));
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs(),
                    "{name}-{ty}: frequencies {a:?} against {b:?}"
                );
            }
            assert_eq!(f.len(), want.head_dim / 2);
            got.rope.scaling = want.rope.scaling.clone();
        }
        assert!(
            (got.rope.theta - want.rope.theta).abs() <= 1e-6 * want.rope.theta,
            "{name}-{ty}"
        );
        got.rope.theta = want.rope.theta;
        assert_eq!(format!("{got:?}"), format!("{want:?}"), "{name}-{ty}");
    }
}

#[test]
fn every_tensor_is_the_directorys_with_the_converters_changes_undone() {
    for (name, ty) in CASES {
        let m = open_gguf(&gguf(name, ty)).unwrap();
        let hf = Weights::open(&common::dir(name)).unwrap();
        let c = &m.config;
        let mut compared = 0;
        for hf_name in hf.names() {
            // The multimodal file's language model sits under `model.language_model.`.
            let ours = hf_name.replace("model.language_model.", "model.");
            if hf_name.contains("visual") || hf_name.starts_with("mtp.") {
                continue;
            }
            let (shape, want) = values(&hf, hf_name);
            // Stacked experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) against the
            // file's, split one an expert.
            let got: Vec<f32> = if let Some(base) = ours.strip_suffix(".experts.gate_up_proj") {
                (0..c.moe.as_ref().unwrap().experts)
                    .flat_map(|e| {
                        let (_, g) = values(&m.weights, &format!("{base}.experts.{e}.gate_proj.weight"));
                        let (_, u) = values(&m.weights, &format!("{base}.experts.{e}.up_proj.weight"));
                        g.into_iter().chain(u)
                    })
                    .collect()
            } else if let Some(base) = ours.strip_suffix(".experts.down_proj") {
                (0..c.moe.as_ref().unwrap().experts)
                    .flat_map(|e| values(&m.weights, &format!("{base}.experts.{e}.down_proj.weight")).1)
                    .collect()
            } else {
                let (got_shape, got) = values(&m.weights, &ours);
                assert_eq!(got_shape, shape, "{name}-{ty}: {hf_name}");
                got
            };
            assert_eq!(got.len(), want.len(), "{name}-{ty}: {hf_name}");
            // Norms and the decay come through f32 arithmetic (1 + w stored, -exp(A_log)).
            let bound = if ours.ends_with("A_log") || (c.arch.is_hybrid() && ours.ends_with("norm.weight")) {
                1e-6
            } else if ours.ends_with("norm.weight")
                || ours.ends_with(".mlp.gate.weight")
                || ours.ends_with("shared_expert_gate.weight")
                || ours.ends_with("dt_bias")
                || ours.ends_with("conv1d.weight")
            {
                // Vectors, routers and the convolution stay f32 in every file type.
                0.0
            } else {
                allowed(ty, &want)
            };
            let err = got.iter().zip(&want).fold(0f32, |e, (a, b)| e.max((a - b).abs()));
            assert!(
                err <= bound,
                "{name}-{ty}: {hf_name} differs by {err:e} (allowed {bound:e})"
            );
            compared += 1;
        }
        println!("{name}-{ty}: {compared} tensors compared");
        assert!(compared > 10, "{name}-{ty}");
    }
}

#[test]
fn gguf_models_match_transformers_on_the_cpu() {
    for (name, ty) in CASES {
        let m = open_gguf(&gguf(name, ty)).unwrap();
        let c_hybrid = m.config.arch.is_hybrid();
        let (tokens, want, _) = reference(name);
        let got = cpu_logits(m, &tokens);
        let err = rel_max_err(&got, &want);
        let top1 = top1_agreement(&got, &want);
        println!(
            "{name}-{ty}: max |error| / max |reference| = {err:.2e}, top-1 {:.1}%",
            100.0 * top1
        );
        println!("{}", common::describe_positions(&got, &want));
        // bf16 holds the directory's weights and f16 rounds a few of them: the directory's own
        // bound. Q8_0 moves every weight by up to half a step, which in a dense model moves the
        // logits by about as much; in these tiny random hybrids it also flips near-tie expert
        // choices (a few positions move by 10-50%), so only most positions' top-1 is asked of
        // them: the exact check of their weights is the test above.
        let (bound, top) = match (ty, c_hybrid) {
            ("q8_0", true) => (1.0, 0.7),
            ("q8_0", false) => (3e-2, 1.0),
            _ => (1e-3, 1.0),
        };
        assert!(err <= bound, "{name}-{ty}: error {err:.2e}");
        assert!(top1 >= top, "{name}-{ty}: top-1 {top1}");
    }
    // The bf16 file holds the directory's weights exactly: the same logits, bit for bit.
    let (tokens, _, _) = reference("qwen3");
    let mut dir = common::open("qwen3", CpuBackend::new(), DType::F32);
    assert_eq!(
        cpu_logits(open_gguf(&gguf("qwen3", "bf16")).unwrap(), &tokens),
        dir.step(&tokens, 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap()
    );
}

/// Every block-quantised type Kestrel reads, dequantised bit for bit as llama.cpp's own
/// dequantiser (`gguf.quants`) does it, over random blocks (`tests/gguf/dequant.gguf`, by
/// `scripts/gguf/make-dequant-fixture.py`, with the package's values in `dequant.safetensors`).
#[test]
fn dequantisation_equals_llama_cpps() {
    use kestrel_model::gguf::Gguf;
    use kestrel_model::gguf_dequant::dequantize;
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let bytes = std::fs::read(dir.join("dequant.gguf")).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let want =
        Weights::from_safetensors_bytes("dequant", std::fs::read(dir.join("dequant.safetensors")).unwrap())
            .unwrap();
    assert_eq!(g.tensors.len(), 8);
    for t in &g.tensors {
        assert_eq!(t.ty.name, t.name);
        let got = dequantize(t.ty, t.data(&bytes)).unwrap();
        let (_, want) = values(&want, &t.name);
        assert_eq!(got.len(), want.len(), "{}", t.name);
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "{}: {differ} of {} values differ", t.name, got.len());
    }
}

/// Every GGUF fixture on CUDA (graph replay), the Q4_K_M files among them: with every rounding
/// fast path off and f32 caches, prefill and token-by-token decode equal the CPU's logits of
/// the same file (max |error| / max |logit| <= 1e-4); with the default fast paths, top-1
/// agreement with the CPU is reported and at least 75% (the hybrids' random routers have near
/// ties that bf16 activations flip, as for their directories in `parity_cuda`). Skips with a
/// notice without a CUDA device.
#[test]
fn gguf_models_run_on_cuda_as_on_the_cpu() {
    use kestrel_cuda::{CudaBackend, Exact, RunMode};
    let Some(dev) = kestrel_testing::gpu::device_or_skip("gguf_models_run_on_cuda_as_on_the_cpu") else {
        return;
    };
    // The Q4_K_M files too: what llama.cpp's quantiser picks for rows this short.
    let q4 = ["llama", "qwen3", "qwen3_moe_all", "qwen3_next", "qwen3_5_moe"].map(|n| (n, "q4_k_m"));
    for (name, ty) in CASES.into_iter().chain(q4) {
        let (tokens, _, _) = reference(name);
        let m = open_gguf(&gguf(name, ty)).unwrap();
        let cpu = cpu_logits(m, &tokens);
        for exact in [true, false] {
            let (d, t) = (&dev, &tokens);
            let (prefill, decode) = {
                let m = open_gguf(&gguf(name, ty)).unwrap();
                let backend = || {
                    let b = CudaBackend::new(d.clone(), RunMode::Graph);
                    if exact {
                        b.with_exact(Exact::ALL)
                    } else {
                        b
                    }
                };
                let cache = if exact { DType::F32 } else { DType::BF16 };
                let prefill = Session::new(m.config, m.weights, backend(), 128, cache)
                    .step(t, 0, Want::AllLogits)
                    .unwrap()
                    .into_logits()
                    .unwrap();
                let m = open_gguf(&gguf(name, ty)).unwrap();
                let mut s = Session::new(m.config, m.weights, backend(), 128, cache);
                let mut decode = Vec::new();
                for (p, &id) in t.iter().enumerate() {
                    decode.extend(s.step(&[id], p, Want::LastLogits).unwrap().into_logits().unwrap());
                }
                (prefill, decode)
            };
            for (mode, got) in [("prefill", &prefill), ("decode", &decode)] {
                let (err, top1) = (rel_max_err(got, &cpu), top1_agreement(got, &cpu));
                println!(
                    "{name}-{ty} on CUDA, {} {mode}: max |error| / max |logit| against the CPU {err:.2e}, top-1 {:.1}%",
                    if exact { "exact" } else { "default" },
                    100.0 * top1
                );
                if exact {
                    assert!(err <= 1e-4, "{name}-{ty}: exact {mode} error {err:.2e}");
                } else {
                    assert!(top1 >= 0.75, "{name}-{ty}: {mode} top-1 {top1}");
                }
            }
        }
    }
}

/// A model split in three files (`tests/gguf/split/`, by `scripts/gguf/make-split-fixture.py`)
/// opens from any of them and is the unsplit file's model, logits bit for bit; a missing split
/// is an error naming it.
#[test]
fn a_split_model_opens_from_any_split() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let (tokens, _, _) = reference("qwen3_next");
    let logits = |path: &std::path::Path| {
        cpu_logits(
            open_gguf(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
            &tokens,
        )
    };
    let whole = logits(&dir.join("qwen3_next-q8_0.gguf"));
    for i in [1, 3] {
        let split = dir.join(format!("split/qwen3_next-q8_0-0000{i}-of-00003.gguf"));
        assert_eq!(logits(&split), whole, "opened from split {i}");
    }
    let t = common::TempDir::new("gguf-split");
    for i in [1, 3] {
        let name = format!("qwen3_next-q8_0-0000{i}-of-00003.gguf");
        std::fs::copy(dir.join("split").join(&name), t.0.join(&name)).unwrap();
    }
    let e = open_gguf(&t.0.join("qwen3_next-q8_0-00001-of-00003.gguf"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("qwen3_next-q8_0-00002-of-00003.gguf") && e.contains("missing"),
        "{e}"
    );
}

/// A file whose quantised tensors would not fit in memory as f32 is refused before anything is
/// dequantised, with both sizes named (a sparse file: a header and 1 TiB of Q8_0 blocks).
#[test]
fn quantised_tensors_past_the_memory_are_refused_up_front() {
    let t = common::TempDir::new("gguf-memory");
    let path = t.0.join("huge.gguf");
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    let (cols, rows) = (4096u64, (1u64 << 40) / 34 * 32 / 4096);
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    s(&mut b, "qwen3");
    s(&mut b, "token_embd.weight");
    b.extend(2u32.to_le_bytes());
    b.extend(cols.to_le_bytes());
    b.extend(rows.to_le_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.resize(b.len().next_multiple_of(32), 0);
    let data = rows * cols / 32 * 34;
    let f = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut &f, &b).unwrap();
    f.set_len(b.len() as u64 + data).unwrap();
    let e = open_gguf(&path).err().unwrap().to_string();
    assert!(e.contains("GiB as f32") && e.contains("available"), "{e}");
}

/// Kestrel's logits on the CPU against llama.cpp's own on the same files (every
/// `NAME-TYPE.llama.safetensors` of `tests/gguf/`, by `scripts/gguf/make-quant-fixtures.py`: the
/// float and Q8_0 conversions, and Q4_K_M files quantised by llama.cpp). llama.cpp rounds
/// differently (its products of quantised weights take 8-bit activations, its float ones f16
/// activations), so the bounds are the two engines' agreement, not bitwise equality: top-1 at
/// every position for the float files and at most positions for the quantised ones, whose
/// random hybrids have near-tie expert choices.
#[test]
fn gguf_models_match_llama_cpp_on_the_same_files() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            Some(name.strip_suffix(".llama.safetensors")?.to_string())
        })
        .collect();
    files.sort();
    assert!(files.len() >= 12, "{files:?}");
    for file in files {
        let want = Weights::from_safetensors_bytes(
            &file,
            std::fs::read(dir.join(format!("{file}.llama.safetensors"))).unwrap(),
        )
        .unwrap();
        let (_, want_logits) = values(&want, "logits");
        let tokens = common::token_ids(&want, "tokens");
        let m = open_gguf(&dir.join(format!("{file}.gguf"))).unwrap();
        let hybrid = m.config.arch.is_hybrid();
        let got = cpu_logits(m, &tokens);
        let (err, top1) = (
            rel_max_err(&got, &want_logits),
            top1_agreement(&got, &want_logits),
        );
        println!(
            "{file}: against llama.cpp, max |error| / max |logit| {err:.2e}, top-1 {:.1}%",
            100.0 * top1
        );
        println!("{file}: {}", common::describe_positions(&got, &want_logits));
        // Where the two differ in top-1, the token Kestrel picks must be within 2% of the
        // logits' range of llama.cpp's best: a near tie that either engine's rounding may swap.
        let near = top1_agreement_or_tie(&got, &want_logits, 0.02);
        let float = file.ends_with("f16");
        let (bound, near_bound) = match (float, hybrid) {
            (true, _) => (1e-2, 1.0),
            (false, false) => (3e-2, 1.0),
            (false, true) => (1.0, 0.7),
        };
        assert!(err <= bound, "{file}: error {err:.2e} against llama.cpp");
        assert!(
            near >= near_bound,
            "{file}: top-1 or a near tie at {near} of positions"
        );
    }
}

/// Metadata that would make the mapping build lists past any model (a layer count of four
/// billion, value heads of llama.cpp's Qwen3.5 key that do not match the tensors) is refused
/// with the key named, at once.
#[test]
fn metadata_past_the_tensors_is_refused_by_key() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    // A u32 value follows its key's length, the key and its type.
    let patch = |file: &str, key: &str, value: u32| {
        let mut bytes = std::fs::read(dir.join(file)).unwrap();
        let at = bytes
            .windows(key.len())
            .position(|w| w == key.as_bytes())
            .unwrap()
            + key.len();
        assert_eq!(&bytes[at..at + 4], &4u32.to_le_bytes(), "{key} is a u32");
        bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
        let start = std::time::Instant::now();
        let e = kestrel_model::gguf_from_bytes(std::path::Path::new(file), bytes)
            .err()
            .unwrap()
            .to_string();
        assert!(start.elapsed().as_secs() < 5, "{e}");
        e
    };
    let e = patch("qwen3_moe_all-bf16.gguf", "qwen3moe.block_count", u32::MAX);
    assert!(
        e.contains("qwen3moe.block_count") && e.contains("4294967295 layers"),
        "{e}"
    );
    let e = patch("qwen3_5_moe-f16.gguf", "qwen35moe.ssm.time_step_rank", 8);
    assert!(e.contains("value heads"), "{e}");
}
