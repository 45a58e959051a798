//! `quantize_dir`: the bf16 qwen3_moe fixture rewritten at 4 bits in groups of 32 is, tensor for
//! tensor, the MLX fixture the fixture script wrote from the same weights, and it runs to the
//! MLX fixture's reference logits; already-quantised input and an occupied output are refused.

mod common;

use common::{dir, reference, rel_max_err};
use kestrel_core::quant::QuantFormat;
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{quantize_dir, ModelConfig, Session, Want, Weights};

const Q4G32: QuantFormat = QuantFormat::mlx(4, 32);

fn out_dir(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("kestrel-quantize-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

#[test]
fn quantised_directory_equals_the_mlx_fixture() {
    let out = out_dir("q4");
    let report = quantize_dir(&dir("qwen3_moe"), &out, Q4G32).unwrap();
    assert!(report.quantized > 0 && report.copied > 0, "{report:?}");
    let (ours, theirs) = (
        Weights::open(&out).unwrap(),
        Weights::open(&dir("qwen3_moe_mlx_q4")).unwrap(),
    );
    assert_eq!(ours.names(), theirs.names());
    for name in ours.names() {
        let (a, b) = (ours.get(name).unwrap(), theirs.get(name).unwrap());
        assert_eq!((a.dtype, a.shape), (b.dtype, b.shape), "{name}");
        assert!(a.bytes == b.bytes, "{name}: bytes differ");
    }
    let (c, want_c) = (
        ModelConfig::from_dir(&out).unwrap(),
        ModelConfig::from_dir(&dir("qwen3_moe_mlx_q4")).unwrap(),
    );
    assert_eq!(c.quant, want_c.quant);
    assert!(
        out.join("generation_config.json").exists(),
        "other files are copied"
    );
    // And it runs to the MLX fixture's reference.
    let (tokens, want, _) = reference("qwen3_moe_mlx_q4");
    let mut s = Session::open(&out, CpuBackend::new(), 64, DType::F32).unwrap();
    let err = rel_max_err(
        &s.step(&tokens, 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap(),
        &want,
    );
    assert!(err <= 1e-3, "{err:e}");
    std::fs::remove_dir_all(&out).unwrap();
}

/// A copy of the quantised directory `q` with every quantised matrix but the experts replaced by
/// its dequantised values in f32. (Experts stay quantised: dense experts are packed as bf16,
/// which would round the dequantised values; their packing is checked byte for byte above.)
/// Kestrel must compute the same logits from both.
fn dequantised_copy(q: &std::path::Path, out: &std::path::Path) {
    use safetensors::tensor::{serialize_to_file, Dtype, TensorView};
    let w = Weights::open(q).unwrap();
    let quant = ModelConfig::from_dir(q).unwrap().quant.unwrap();
    let dtype = |d: DType| match d {
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F32 => Dtype::F32,
        DType::U32 => Dtype::U32,
        other => panic!("{other}"),
    };
    let bf = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()
    };
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in w.names() {
        let t = w.get(name).unwrap();
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let quantised = t.dtype == DType::U32 && w.contains(&format!("{base}.scales"));
        let part_of_quantised = ["scales", "biases"].iter().any(|p| {
            name.strip_suffix(&format!(".{p}"))
                .is_some_and(|b| w.contains(&format!("{b}.weight")))
        });
        let expert = name.contains(".switch_mlp.");
        if expert || !(quantised || part_of_quantised) {
            tensors.push((
                name.to_string(),
                dtype(t.dtype),
                t.shape.to_vec(),
                t.bytes.to_vec(),
            ));
            continue;
        }
        if part_of_quantised {
            continue;
        }
        let (s, b) = (
            w.get(&format!("{base}.scales")).unwrap(),
            w.get(&format!("{base}.biases")).unwrap(),
        );
        let (rows, words, groups) = (t.shape[0], t.shape[1], s.shape[1]);
        let bits = quant.format_for(base).unwrap().bits;
        let cols = words * 32 / bits as usize;
        let m = kestrel_core::quant::QuantMatrix {
            format: QuantFormat::mlx(bits, cols / groups),
            rows,
            cols,
            weight: t
                .bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            scales: bf(s.bytes),
            biases: bf(b.bytes),
        };
        let bytes: Vec<u8> = m.dequantize().iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name.to_string(), Dtype::F32, vec![rows, cols], bytes));
    }
    std::fs::create_dir_all(out).unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
    // The quantisation section stays: the experts still use it.
    std::fs::copy(q.join("config.json"), out.join("config.json")).unwrap();
}

#[test]
fn hybrid_models_quantise_and_compute_as_their_dequantised_weights() {
    // Qwen3-Next (fused projections) and Qwen3.5 (multimodal, separate projections), at 8 and
    // 4 bits: the quantised directory and a dense copy holding its dequantised weights give the
    // same logits, so every quantised tensor is read and used as the dense one would be.
    for (name, bits) in [
        ("llama", 4),
        ("qwen3_moe", 4),
        ("qwen3_next", 8),
        ("qwen3_next", 4),
        ("qwen3_5_moe", 8),
        ("qwen3_5_moe", 4),
    ] {
        let q = out_dir(&format!("{name}-{bits}"));
        let d = out_dir(&format!("{name}-{bits}-deq"));
        let format = QuantFormat::mlx(bits, 32);
        quantize_dir(&dir(name), &q, format).unwrap();
        dequantised_copy(&q, &d);
        let (tokens, _, _) = reference(name);
        let run = |p: &std::path::Path| {
            Session::open(p, CpuBackend::new(), 64, DType::F32)
                .unwrap()
                .step(&tokens, 0, Want::AllLogits)
                .unwrap()
                .into_logits()
                .unwrap()
        };
        let (got, want) = (run(&q), run(&d));
        let err = rel_max_err(&got, &want);
        println!("{name} at {bits} bits vs its dequantised weights: {err:.2e}");
        assert!(err <= 1e-4, "{name}: {err:e}");
        std::fs::remove_dir_all(&q).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn refuses_quantised_input_and_an_occupied_output() {
    let msg = quantize_dir(&dir("qwen3_moe_mlx_q4"), &out_dir("twice"), Q4G32)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("already quantised"), "{msg}");
    let msg = quantize_dir(&dir("qwen3"), &dir("llama"), Q4G32)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("is not empty"), "{msg}");
}

/// Written in shards (here one a layer, with a limit of one byte): an index and several files
/// holding, tensor for tensor, what the single file holds, loading and computing the same.
#[test]
fn sharded_output_equals_one_file() {
    let (one, many) = (out_dir("one-shard"), out_dir("shards"));
    quantize_dir(&dir("qwen3_next"), &one, Q4G32).unwrap();
    kestrel_model::quantize::quantize_dir_sharded(&dir("qwen3_next"), &many, Q4G32, 1).unwrap();
    let index = many.join("model.safetensors.index.json");
    assert!(index.exists() && !many.join("model.safetensors").exists());
    let files = std::fs::read_dir(&many)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".safetensors")
        })
        .count();
    assert_eq!(files, 5, "four layers and the rest");
    let (a, b) = (Weights::open(&one).unwrap(), Weights::open(&many).unwrap());
    assert_eq!(a.names(), b.names());
    for name in a.names() {
        let (x, y) = (a.get(name).unwrap(), b.get(name).unwrap());
        assert!(
            x.dtype == y.dtype && x.shape == y.shape && x.bytes == y.bytes,
            "{name}"
        );
    }
    let (tokens, _, _) = reference("qwen3_next");
    let logits = |d: &std::path::Path| {
        Session::open(d, CpuBackend::new(), 64, DType::F32)
            .unwrap()
            .step(&tokens, 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap()
    };
    assert_eq!(logits(&one), logits(&many));
    std::fs::remove_dir_all(&one).unwrap();
    std::fs::remove_dir_all(&many).unwrap();
}
