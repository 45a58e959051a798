//! `write_model_dir` writes a model's tensors and config as a directory that opens to the same
//! model: every tensor byte for byte and the same logits, in one file or in shards with an
//! index; it never writes into a folder that holds anything.

mod common;

use common::{dir, reference};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{check_empty_dst, write_model_dir, ModelConfig, Session, Want, Weights};

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp(tag: &str) -> TempDir {
    let d = std::env::temp_dir().join(format!("kestrel-write-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    TempDir(d)
}

fn logits(d: &std::path::Path, tokens: &[u32]) -> Vec<f32> {
    let mut s = Session::open(d, CpuBackend::new(), 64, DType::F32).unwrap();
    s.step(tokens, 0, Want::AllLogits).unwrap().into_logits().unwrap()
}

#[test]
fn a_written_directory_is_the_same_model() {
    let src = dir("qwen3_moe");
    let w = Weights::open(&src).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let (tokens, _, _) = reference("qwen3_moe");
    let want = logits(&src, &tokens);
    for (tag, shard) in [("one", usize::MAX), ("shards", 200_000)] {
        let out = temp(tag);
        let bytes = write_model_dir(&out.0, &config, &w, shard).unwrap();
        assert_eq!(bytes, w.total_bytes());
        let index = out.0.join("model.safetensors.index.json").exists();
        assert_eq!(index, tag == "shards", "{tag}");
        let back = Weights::open(&out.0).unwrap();
        let mut names = back.names();
        names.sort();
        let mut orig = w.names();
        orig.sort();
        assert_eq!(names, orig);
        for name in orig {
            let (a, b) = (w.get(name).unwrap(), back.get(name).unwrap());
            assert_eq!((a.dtype, a.shape, a.bytes), (b.dtype, b.shape, b.bytes), "{name}");
        }
        assert_eq!(
            ModelConfig::from_dir(&out.0).unwrap(),
            ModelConfig::from_dir(&src).unwrap()
        );
        assert!(logits(&out.0, &tokens) == want, "{tag}: logits differ");
    }
}

#[test]
fn a_folder_that_holds_anything_is_refused() {
    let out = temp("taken");
    std::fs::create_dir_all(&out.0).unwrap();
    assert!(check_empty_dst(&out.0).is_ok(), "an empty folder is fine");
    std::fs::write(out.0.join("notes.txt"), "mine").unwrap();
    let w = Weights::open(&dir("qwen3_moe")).unwrap();
    let err = write_model_dir(&out.0, &serde_json::json!({}), &w, usize::MAX).unwrap_err();
    assert!(err.to_string().contains("not empty"), "{err}");
    assert_eq!(std::fs::read_to_string(out.0.join("notes.txt")).unwrap(), "mine");
    assert_eq!(
        std::fs::read_dir(&out.0).unwrap().count(),
        1,
        "nothing was written"
    );
}
