//! Fuzz target: `model.safetensors.index.json`, read by `Weights::open` from a directory of this
//! process's own that holds the input as the index beside two small valid shards, then every
//! tensor found looked up. The index decides which of the directory's files are mapped.

#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kestrel_model::Weights;
use libfuzzer_sys::fuzz_target;

/// One tensor of a shard: name, safetensors dtype, shape, bytes per value.
type Entry = (&'static str, &'static str, &'static [usize], usize);

/// The shards: file name and tensors.
const SHARDS: [(&str, &[Entry]); 2] = [
    (
        "model-00001-of-00002.safetensors",
        &[
            ("model.embed_tokens.weight", "F32", &[4, 2], 4),
            ("model.norm.weight", "BF16", &[2], 2),
        ],
    ),
    (
        "model-00002-of-00002.safetensors",
        &[
            ("lm_head.weight", "F16", &[4, 2], 2),
            ("model.ids", "I64", &[3], 8),
        ],
    ),
];

/// A safetensors file of `tensors`, laid out one after the other, with bytes counting up.
fn shard(tensors: &[Entry]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut at = 0;
    for &(name, dtype, shape, size) in tensors {
        let len = shape.iter().product::<usize>() * size;
        header.insert(
            name.into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    let mut header = serde_json::to_vec(&header).expect("a map of strings and numbers serialises");
    // The data starts 8-byte aligned, as the safetensors writer pads it.
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend((0..at).map(|i| i as u8));
    file
}

/// The directory, made with its shards on first use; each fuzzing process has its own (under
/// `TMPDIR`, which the scripts point into fuzz/target).
fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kestrel-fuzz-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("the temporary directory is writable");
        for (name, tensors) in SHARDS {
            std::fs::write(dir.join(name), shard(tensors)).expect("the temporary directory is writable");
        }
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = dir();
    std::fs::write(dir.join("model.safetensors.index.json"), data)
        .expect("the temporary directory is writable");
    let Ok(weights) = Weights::open(dir) else {
        return;
    };
    let mut sum = weights.total_bytes();
    for name in weights.names() {
        if let Ok(tensor) = weights.get(name) {
            sum = sum.wrapping_add(tensor.bytes.iter().map(|&b| usize::from(b)).sum::<usize>());
        }
        if let Some(span) = weights.file_span(name) {
            let (path, ident) = weights
                .file(span.file)
                .expect("a span names a file of the weights");
            assert!(
                span.offset + span.len as u64 <= ident.len,
                "{name} in {}",
                path.display()
            );
        }
    }
    std::hint::black_box(sum);
});
