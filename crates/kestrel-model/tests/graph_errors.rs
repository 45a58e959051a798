//! `Forward::build` refuses checkpoints that do not fit the config, naming the tensor: a
//! transposed projection, a missing tensor, a chunk past the context.

use std::path::PathBuf;

use kestrel_core::DType;
use kestrel_model::{Forward, ForwardSpec, ModelConfig, Weights};
use safetensors::tensor::{serialize_to_file, TensorView};
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name)
}

/// A copy of the llama fixture with `edit` applied to its tensor list.
fn edited(tag: &str, edit: impl Fn(&str, Vec<usize>) -> Option<Vec<usize>>) -> PathBuf {
    let src = fixture("llama");
    let dst = std::env::temp_dir().join(format!("kestrel-graph-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::copy(src.join("config.json"), dst.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter_map(|(name, t)| {
            edit(&name, t.shape().to_vec())
                .map(|shape| (name, TensorView::new(t.dtype(), shape, t.data()).unwrap()))
        })
        .collect();
    serialize_to_file(kept, None, &dst.join("model.safetensors")).unwrap();
    dst
}

fn build_error(dir: &PathBuf, spec: ForwardSpec) -> String {
    let c = ModelConfig::from_dir(dir).unwrap();
    let w = Weights::open(dir).unwrap();
    let e = Forward::build(&c, &w, spec).err().expect("the build must fail");
    std::fs::remove_dir_all(dir).unwrap();
    e.to_string()
}

const SPEC: ForwardSpec = ForwardSpec {
    all_logits: true,
    ..ForwardSpec::new(4, 8, DType::F32)
};

#[test]
fn a_transposed_projection_is_refused() {
    let d = edited("transposed", |name, shape| {
        Some(if name == "model.layers.1.self_attn.k_proj.weight" {
            vec![shape[1], shape[0]]
        } else {
            shape
        })
    });
    let msg = build_error(&d, SPEC);
    assert!(
        msg.contains("model.layers.1.self_attn.k_proj.weight")
            && msg.contains("config.json implies [32, 64]"),
        "{msg}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let d = edited("missing", |name, shape| {
        (name != "model.layers.0.mlp.up_proj.weight").then_some(shape)
    });
    let msg = build_error(&d, SPEC);
    assert!(msg.contains("model.layers.0.mlp.up_proj.weight"), "{msg}");
}

#[test]
fn a_chunk_past_the_context_is_refused_before_any_work() {
    let d = edited("ctx", |_, shape| Some(shape));
    let msg = build_error(&d, ForwardSpec { past: 6, ..SPEC });
    assert!(msg.contains("context of 8"), "{msg}");
}
