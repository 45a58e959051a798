//! End-to-end parity on the CPU backend against transformers: the fixtures' fp32 reference
//! logits (max |error| / max |reference| <= 1e-3) and 24-token greedy continuations (identical),
//! both as one prefill of the whole sequence and as a prefill of one token followed by
//! single-token decode steps.

use std::path::PathBuf;

use kestrel_core::{Backend, DType};
use kestrel_cpu::CpuBackend;
use kestrel_model::{Forward, ForwardSpec, ModelConfig, Weights};

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/parity")
        .join(name)
}

struct Model {
    c: ModelConfig,
    w: Weights,
    cpu: CpuBackend,
    uploaded: bool,
}

impl Model {
    fn open(name: &str) -> Model {
        let d = dir(name);
        Model {
            c: ModelConfig::from_dir(&d).unwrap(),
            w: Weights::open(&d).unwrap(),
            cpu: CpuBackend::new(),
            uploaded: false,
        }
    }

    /// Logits (`[tokens or 1, vocab]`) of `ids` at positions `past..`.
    fn forward(&mut self, ids: &[u32], past: usize, all_logits: bool) -> Vec<f32> {
        let spec = ForwardSpec {
            tokens: ids.len(),
            past,
            ctx: 64,
            cache_dtype: DType::F32,
            all_logits,
        };
        let f = Forward::build(&self.c, &self.w, spec).unwrap();
        let mut p = self.cpu.prepare(&f.graph).unwrap();
        if !self.uploaded {
            f.upload(&self.w, &mut self.cpu, &mut p).unwrap();
            self.uploaded = true;
        }
        let pos: Vec<u32> = (past..past + ids.len()).map(|p| p as u32).collect();
        self.cpu.upload(&mut p, f.tokens, ids).unwrap();
        self.cpu.upload(&mut p, f.positions, &pos).unwrap();
        self.cpu.run(&mut p).unwrap();
        self.cpu.download::<f32>(&p, f.logits).unwrap()
    }
}

fn reference(name: &str) -> (Vec<u32>, Vec<f32>, Vec<u32>) {
    let r = Weights::open(&dir(name).join("reference")).unwrap();
    let tokens: Vec<u32> = r
        .get("tokens")
        .unwrap()
        .bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let logits: Vec<f32> = r
        .get("logits")
        .unwrap()
        .bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let greedy: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("reference/greedy.json")).unwrap())
            .unwrap();
    let cont = greedy["continuation"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    (tokens, logits, cont)
}

fn rel_max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn check(name: &str) {
    let (tokens, want, cont) = reference(name);
    let vocab = 256;
    // Prefill: the whole sequence in one graph.
    let mut m = Model::open(name);
    let got = m.forward(&tokens, 0, true);
    let err = rel_max_err(&got, &want);
    println!("{name}: prefill max |error| / max |reference| = {err:.2e}");
    assert!(err <= 1e-3, "{name}: prefill error {err:.2e}");
    // Decode: one token at a time through the single-token path.
    let mut m = Model::open(name);
    let mut rows = Vec::new();
    for (t, &id) in tokens.iter().enumerate() {
        rows.extend(m.forward(&[id], t, false));
    }
    let err = rel_max_err(&rows, &want);
    println!("{name}: decode max |error| / max |reference| = {err:.2e}");
    assert!(err <= 1e-3, "{name}: decode error {err:.2e}");
    // Greedy continuation from the decode state.
    let mut next = argmax(&rows[(tokens.len() - 1) * vocab..]);
    let mut generated = vec![next];
    for t in tokens.len()..tokens.len() + cont.len() - 1 {
        next = argmax(&m.forward(&[next], t, false));
        generated.push(next);
    }
    assert_eq!(generated, cont, "{name}: greedy continuation");
}

#[test]
fn llama_matches_transformers() {
    check("llama");
}

#[test]
fn qwen3_matches_transformers() {
    check("qwen3");
}

#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3_moe");
}

#[test]
fn qwen3_moe_mlx_4bit_matches_its_dequantised_reference() {
    check("qwen3_moe_mlx_q4");
}

#[test]
fn qwen3_next_matches_transformers() {
    check("qwen3_next");
}

#[test]
fn qwen3_5_moe_text_model_matches_transformers() {
    check("qwen3_5_moe");
}
