//! `Weights` over model directories written here: one file, shards with an index, MLX-style
//! unnamed files, and broken ones (each error must name what is wrong).

mod common;

use std::path::Path;

use common::TempDir;
use kestrel_core::DType;
use kestrel_model::{ModelError, Weights};
use safetensors::tensor::{serialize_to_file, Dtype, TensorView};

/// Writes `tensors` (name, dtype, shape, bytes) as one safetensors file.
fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    serialize_to_file(views, None, path).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn single_file_tensors_come_back_as_written() {
    let d = TempDir::new("weights-single");
    let emb: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    write(
        &d.0.join("model.safetensors"),
        &[
            (
                "model.embed_tokens.weight",
                Dtype::F32,
                vec![3, 4],
                f32_bytes(&emb),
            ),
            (
                "model.norm.weight",
                Dtype::BF16,
                vec![4],
                vec![0x80, 0x3f, 0, 0x40, 0, 0, 0, 0],
            ),
            ("lm_head.weight", Dtype::U32, vec![4, 1], vec![7; 16]),
        ],
    );
    let w = Weights::open(&d.0).unwrap();
    assert_eq!(
        w.names(),
        vec!["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    );
    let t = w.get("model.embed_tokens.weight").unwrap();
    assert_eq!(
        (t.dtype, t.shape, t.elem_count()),
        (DType::F32, &[3usize, 4][..], 12)
    );
    assert_eq!(t.bytes, &f32_bytes(&emb)[..]);
    assert_eq!(w.get("model.norm.weight").unwrap().dtype, DType::BF16);
    assert_eq!(w.get("lm_head.weight").unwrap().bytes, &[7u8; 16][..]);
    assert_eq!(w.total_bytes(), 48 + 8 + 16);
    let e = w.get("model.layers.0.self_attn.q_proj.weight").unwrap_err();
    assert!(matches!(e, ModelError::MissingTensor { .. }));
    assert!(
        e.to_string().contains("model.layers.0.self_attn.q_proj.weight"),
        "{e}"
    );
}

#[test]
fn shards_follow_the_index() {
    let d = TempDir::new("weights-sharded");
    write(
        &d.0.join("model-00001-of-00002.safetensors"),
        &[("a", Dtype::F32, vec![2], f32_bytes(&[1.0, 2.0]))],
    );
    write(
        &d.0.join("model-00002-of-00002.safetensors"),
        &[("b", Dtype::F16, vec![1], vec![0, 0x3c])],
    );
    let index = serde_json::json!({
        "metadata": {"total_size": 10},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    });
    std::fs::write(d.0.join("model.safetensors.index.json"), index.to_string()).unwrap();
    // A stray file the index does not name is not read.
    std::fs::write(d.0.join("stray.safetensors"), b"not a safetensors file").unwrap();
    let w = Weights::open(&d.0).unwrap();
    assert_eq!(w.names(), vec!["a", "b"]);
    assert_eq!(w.get("a").unwrap().bytes, &f32_bytes(&[1.0, 2.0])[..]);
    assert_eq!(w.get("b").unwrap().dtype, DType::F16);
}

#[test]
fn without_an_index_every_safetensors_file_is_read() {
    let d = TempDir::new("weights-mlx");
    write(
        &d.0.join("weights.00.safetensors"),
        &[("x", Dtype::U8, vec![3], vec![1, 2, 3])],
    );
    write(
        &d.0.join("weights.01.safetensors"),
        &[("y", Dtype::I32, vec![1], vec![5, 0, 0, 0])],
    );
    let w = Weights::open(&d.0).unwrap();
    assert_eq!(w.names(), vec!["x", "y"]);
}

#[test]
fn broken_directories_are_errors_that_name_the_cause() {
    let empty = TempDir::new("weights-empty");
    let msg = Weights::open(&empty.0).err().unwrap().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");

    let corrupt = TempDir::new("weights-corrupt");
    std::fs::write(corrupt.0.join("model.safetensors"), [0xffu8; 16]).unwrap();
    let msg = Weights::open(&corrupt.0).err().unwrap().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");

    let missing_shard = TempDir::new("weights-missing-shard");
    let index = serde_json::json!({"weight_map": {"a": "model-00001-of-00001.safetensors"}});
    std::fs::write(
        missing_shard.0.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let msg = Weights::open(&missing_shard.0).err().unwrap().to_string();
    assert!(msg.contains("model-00001-of-00001.safetensors"), "{msg}");

    let wrong_index = TempDir::new("weights-wrong-index");
    write(
        &wrong_index.0.join("s.safetensors"),
        &[("a", Dtype::F32, vec![1], f32_bytes(&[1.0]))],
    );
    let index = serde_json::json!({"weight_map": {"a": "s.safetensors", "b": "s.safetensors"}});
    std::fs::write(
        wrong_index.0.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let msg = Weights::open(&wrong_index.0).err().unwrap().to_string();
    assert!(msg.contains("tensor b") && msg.contains("s.safetensors"), "{msg}");

    let escape = TempDir::new("weights-escape");
    let index = serde_json::json!({"weight_map": {"a": "../other/model.safetensors"}});
    std::fs::write(escape.0.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let msg = Weights::open(&escape.0).err().unwrap().to_string();
    assert!(msg.contains("outside the directory"), "{msg}");

    let duplicate = TempDir::new("weights-duplicate");
    write(
        &duplicate.0.join("a.safetensors"),
        &[("t", Dtype::U8, vec![1], vec![1])],
    );
    write(
        &duplicate.0.join("b.safetensors"),
        &[("t", Dtype::U8, vec![1], vec![2])],
    );
    let msg = Weights::open(&duplicate.0).err().unwrap().to_string();
    assert!(msg.contains("tensor t is also in"), "{msg}");

    let fp8 = TempDir::new("weights-fp8");
    write(
        &fp8.0.join("model.safetensors"),
        &[("q", Dtype::F8_E4M3, vec![2], vec![1, 2])],
    );
    let w = Weights::open(&fp8.0).unwrap();
    let msg = w.get("q").unwrap_err().to_string();
    assert!(msg.contains("F8_E4M3") && msg.contains("tensor q"), "{msg}");
}
