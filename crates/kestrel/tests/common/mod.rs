//! What the text CLI tests share: a copy of the qwen3 fixture widened to the test tokenizer's
//! vocabulary, carrying that tokenizer.

use std::path::PathBuf;

use kestrel_core::rng::Rng;
use kestrel_text::Tokenizer;
use safetensors::tensor::{serialize_to_file, Dtype, SafeTensors, TensorView};
use serde_json::Value;

pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn root() -> PathBuf {
    kestrel_testing::fixtures::path("crates")
}

/// The qwen3 fixture at the tokenizer's vocabulary, with the tokenizer and `eos_token_id`.
pub fn model_dir(tag: &str, eos: Option<u32>) -> TempDir {
    let out = TempDir(std::env::temp_dir().join(format!("kestrel-text-{tag}-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&out.0);
    std::fs::create_dir_all(&out.0).unwrap();
    let fixture = root().join("kestrel-model/tests/parity/qwen3");
    let tok_dir = root().join("kestrel-text/tests/tokenizer");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tok_dir.join(f), out.0.join(f)).unwrap();
    }
    let vocab = Tokenizer::from_dir(&tok_dir).unwrap().unwrap().vocab_size();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = vocab.into();
    std::fs::write(out.0.join("config.json"), config.to_string()).unwrap();
    let generation = match eos {
        Some(e) => serde_json::json!({"eos_token_id": e}),
        None => serde_json::json!({}),
    };
    std::fs::write(out.0.join("generation_config.json"), generation.to_string()).unwrap();
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let mut shape = view.shape().to_vec();
        let data = if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            // Seeded by the name: the same rows in every copy, whatever order the file lists.
            let mut rng = Rng::new(11 + u64::from(name == "lm_head.weight"));
            shape[0] = vocab;
            (0..vocab * shape[1])
                .flat_map(|_| half::bf16::from_f32(rng.symmetric()).to_le_bytes())
                .collect()
        } else {
            view.data().to_vec()
        };
        assert_eq!(view.dtype(), Dtype::BF16);
        tensors.push((name, shape, data));
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, s, d)| (n.clone(), TensorView::new(Dtype::BF16, s.clone(), d).unwrap()))
        .collect();
    serialize_to_file(views, None, &out.0.join("model.safetensors")).unwrap();
    out
}
