//! `pack_experts` from the three ways checkpoints store experts, checked value by value against
//! the layout's offsets, and the errors for missing or mis-shaped tensors; where the packed
//! spans are byte copies of the files, the disk tier's direct reads give the same bytes.

mod common;

use std::path::Path;

use common::TempDir;

use half::bf16;
use kestrel_core::ir::{ExpertFormat, ExpertLayout, MatrixSpan};
use kestrel_core::quant::{QuantFormat, QuantMatrix};
use kestrel_core::rng::Rng;
use kestrel_model::{
    expert_copy_parts, expert_source, pack_experts, ExpertReader, ExpertSource, ModelError, Weights,
};
use safetensors::tensor::{serialize_to_file, Dtype, TensorView};

const E: usize = 3;
const HIDDEN: usize = 64;
const INTER: usize = 32;
const MLP: &str = "model.layers.0.mlp";
const Q4G32: QuantFormat = QuantFormat::mlx(4, 32);

fn write(path: &Path, tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    serialize_to_file(views, None, path).unwrap();
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect()
}

/// Random matrices per expert: gate, up `[INTER, HIDDEN]`, down `[HIDDEN, INTER]`, already on
/// the bf16 grid so every path stores them exactly.
fn experts(rng: &mut Rng) -> Vec<[Vec<f32>; 3]> {
    let mut m = |n: usize| -> Vec<f32> { (0..n).map(|_| bf16::from_f32(rng.symmetric()).to_f32()).collect() };
    (0..E)
        .map(|_| [m(INTER * HIDDEN), m(INTER * HIDDEN), m(HIDDEN * INTER)])
        .collect()
}

fn layout(format: ExpertFormat) -> ExpertLayout {
    ExpertLayout::uniform(E, HIDDEN, INTER, format)
}

fn spans(l: &ExpertLayout) -> [MatrixSpan; 3] {
    [l.gate(), l.up(), l.down_span()]
}

fn bf16_at(buf: &[u8], at: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| bf16::from_le_bytes([buf[at + 2 * i], buf[at + 2 * i + 1]]).to_f32())
        .collect()
}

/// The layer's experts read from the files by the disk tier, in a shuffled order and put back
/// in place, when the layout's spans are byte copies of the files (None otherwise).
fn read_from_disk(w: &Weights, l: &ExpertLayout) -> Option<Vec<u8>> {
    let parts = expert_copy_parts(w, MLP, l).unwrap()?;
    let mut reader = ExpertReader::new(w);
    let span = l.span_bytes();
    let order: Vec<u32> = (0..E as u32).rev().collect();
    let mut got = vec![0xAAu8; E * span];
    reader.read(&parts, span, &order, &mut got).unwrap();
    assert_eq!(reader.stats.experts, E as u64);
    let mut out = vec![0u8; E * span];
    for (i, &e) in order.iter().enumerate() {
        out[e as usize * span..][..span].copy_from_slice(&got[i * span..][..span]);
    }
    Some(out)
}

fn per_expert_dir(tag: &str, x: &[[Vec<f32>; 3]]) -> TempDir {
    let d = TempDir::new(tag);
    let mut t = Vec::new();
    for (e, mats) in x.iter().enumerate() {
        for (m, name) in ["gate_proj", "up_proj", "down_proj"].iter().enumerate() {
            let shape = if m < 2 {
                vec![INTER, HIDDEN]
            } else {
                vec![HIDDEN, INTER]
            };
            t.push((
                format!("{MLP}.experts.{e}.{name}.weight"),
                Dtype::BF16,
                shape,
                bf16_bytes(&mats[m]),
            ));
        }
    }
    write(&d.0.join("model.safetensors"), t);
    d
}

#[test]
fn per_expert_and_stacked_sources_pack_the_same_bf16_buffer() {
    let (mut rng, seed) = Rng::from_time();
    let x = experts(&mut rng);
    let per = per_expert_dir("per", &x);
    let stacked = TempDir::new("stacked");
    let gate_up: Vec<f32> = x.iter().flat_map(|m| m[0].iter().chain(&m[1]).copied()).collect();
    let down: Vec<f32> = x.iter().flat_map(|m| m[2].iter().copied()).collect();
    write(
        &stacked.0.join("model.safetensors"),
        vec![
            (
                format!("{MLP}.experts.gate_up_proj"),
                Dtype::BF16,
                vec![E, 2 * INTER, HIDDEN],
                bf16_bytes(&gate_up),
            ),
            (
                format!("{MLP}.experts.down_proj"),
                Dtype::BF16,
                vec![E, HIDDEN, INTER],
                bf16_bytes(&down),
            ),
        ],
    );
    let (wp, ws) = (Weights::open(&per.0).unwrap(), Weights::open(&stacked.0).unwrap());
    assert_eq!(expert_source(&wp, MLP).unwrap(), ExpertSource::PerExpert);
    assert_eq!(expert_source(&ws, MLP).unwrap(), ExpertSource::Stacked);
    let l = layout(ExpertFormat::Bf16);
    let (a, b) = (
        pack_experts(&wp, MLP, &l).unwrap(),
        pack_experts(&ws, MLP, &l).unwrap(),
    );
    assert_eq!(a.len(), l.total_bytes());
    assert_eq!(a, b, "seed {seed}");
    assert!(
        read_from_disk(&wp, &l).unwrap() == a,
        "per-expert files read directly"
    );
    assert!(
        read_from_disk(&ws, &l).unwrap() == a,
        "stacked files read directly"
    );
    for (e, mats) in x.iter().enumerate() {
        for (m, at) in spans(&l).iter().enumerate() {
            assert_eq!(
                bf16_at(&a, e * l.span_bytes() + at.weight, mats[m].len()),
                mats[m],
                "expert {e} matrix {m}"
            );
        }
    }
}

#[test]
fn dense_experts_are_quantised_on_load_as_the_host_quantiser_does() {
    let (mut rng, seed) = Rng::from_time();
    let x = experts(&mut rng);
    let d = per_expert_dir("quant", &x);
    let w = Weights::open(&d.0).unwrap();
    let l = layout(ExpertFormat::Quant(Q4G32));
    let buf = pack_experts(&w, MLP, &l).unwrap();
    assert!(read_from_disk(&w, &l).is_none(), "quantising is not a copy");
    for (e, mats) in x.iter().enumerate() {
        for (m, at) in spans(&l).iter().enumerate() {
            let (rows, cols) = if m < 2 { (INTER, HIDDEN) } else { (HIDDEN, INTER) };
            let q = QuantMatrix::quantize(&mats[m], rows, cols, Q4G32);
            let base = e * l.span_bytes();
            let words: Vec<u32> = buf[base + at.weight..base + at.weight + 4 * q.weight.len()]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(words, q.weight, "expert {e} matrix {m} (seed {seed})");
            let n = q.scales.len();
            let scales: Vec<f32> = bf16_at(&buf, base + at.scales, n);
            let biases: Vec<f32> = bf16_at(&buf, base + at.biases, n);
            assert_eq!(scales, q.scales);
            assert_eq!(biases, q.biases);
        }
    }
}

#[test]
fn mlx_switch_experts_are_copied_or_dequantised() {
    let (mut rng, seed) = Rng::from_time();
    let x = experts(&mut rng);
    let d = TempDir::new("mlx");
    let mut t = Vec::new();
    let mut stored: Vec<[QuantMatrix; 3]> = Vec::new();
    for mats in &x {
        stored.push([0, 1, 2].map(|m| {
            let (rows, cols) = if m < 2 { (INTER, HIDDEN) } else { (HIDDEN, INTER) };
            QuantMatrix::quantize(&mats[m], rows, cols, Q4G32)
        }));
    }
    for (m, name) in ["gate_proj", "up_proj", "down_proj"].iter().enumerate() {
        let (rows, cols) = if m < 2 { (INTER, HIDDEN) } else { (HIDDEN, INTER) };
        let words: Vec<u8> = stored
            .iter()
            .flat_map(|s| s[m].weight.iter().flat_map(|w| w.to_le_bytes()))
            .collect();
        let parts: Vec<(Vec<u8>, Vec<u8>)> = stored.iter().map(|s| s[m].group_bytes().unwrap()).collect();
        let scales: Vec<u8> = parts.iter().flat_map(|p| p.0.clone()).collect();
        let biases: Vec<u8> = parts.iter().flat_map(|p| p.1.clone()).collect();
        let base = format!("{MLP}.switch_mlp.{name}");
        t.push((
            format!("{base}.weight"),
            Dtype::U32,
            vec![E, rows, cols / 8],
            words,
        ));
        t.push((
            format!("{base}.scales"),
            Dtype::BF16,
            vec![E, rows, cols / 32],
            scales,
        ));
        t.push((
            format!("{base}.biases"),
            Dtype::BF16,
            vec![E, rows, cols / 32],
            biases,
        ));
    }
    write(&d.0.join("model.safetensors"), t);
    let w = Weights::open(&d.0).unwrap();
    assert_eq!(expert_source(&w, MLP).unwrap(), ExpertSource::MlxSwitch);

    // Same format: the bytes are the stored ones.
    let l = layout(ExpertFormat::Quant(Q4G32));
    let buf = pack_experts(&w, MLP, &l).unwrap();
    assert!(read_from_disk(&w, &l).unwrap() == buf, "MLX files read directly");
    for (e, s) in stored.iter().enumerate() {
        for (m, at) in spans(&l).iter().enumerate() {
            let base = e * l.span_bytes() + at.weight;
            let words: Vec<u32> = buf[base..base + 4 * s[m].weight.len()]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(words, s[m].weight, "seed {seed}");
        }
    }
    // A bf16 layout gets the dequantised values.
    let l = layout(ExpertFormat::Bf16);
    let buf = pack_experts(&w, MLP, &l).unwrap();
    assert!(read_from_disk(&w, &l).is_none(), "dequantising is not a copy");
    for (e, s) in stored.iter().enumerate() {
        for (m, at) in spans(&l).iter().enumerate() {
            let want: Vec<f32> = s[m]
                .dequantize()
                .iter()
                .map(|v| bf16::from_f32(*v).to_f32())
                .collect();
            assert_eq!(
                bf16_at(&buf, e * l.span_bytes() + at.weight, want.len()),
                want,
                "seed {seed}"
            );
        }
    }
    // Another quantised format is refused, naming the tensor.
    let l = layout(ExpertFormat::Quant(QuantFormat::mlx(8, 32)));
    let msg = pack_experts(&w, MLP, &l).unwrap_err().to_string();
    assert!(msg.contains("switch_mlp") && msg.contains("bits: 4"), "{msg}");
}

#[test]
fn missing_and_mis_shaped_experts_are_named() {
    let (mut rng, _) = Rng::from_time();
    let x = experts(&mut rng);
    let d = TempDir::new("broken");
    // Expert 2 lacks its down matrix; expert 1's up matrix has the wrong shape.
    let mut t = Vec::new();
    for (e, mats) in x.iter().enumerate() {
        for (m, name) in ["gate_proj", "up_proj", "down_proj"].iter().enumerate() {
            if e == 2 && m == 2 {
                continue;
            }
            let shape = match (e, m) {
                (1, 1) => vec![HIDDEN, INTER],
                (_, 2) => vec![HIDDEN, INTER],
                _ => vec![INTER, HIDDEN],
            };
            t.push((
                format!("{MLP}.experts.{e}.{name}.weight"),
                Dtype::BF16,
                shape,
                bf16_bytes(&mats[m]),
            ));
        }
    }
    write(&d.0.join("model.safetensors"), t);
    let w = Weights::open(&d.0).unwrap();
    let e = pack_experts(&w, MLP, &layout(ExpertFormat::Bf16)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("experts.1.up_proj.weight") || msg.contains("experts.2.down_proj.weight"),
        "{msg}"
    );
    let none = Weights::open(&per_expert_dir("other-layer", &x).0).unwrap();
    let e = pack_experts(&none, "model.layers.7.mlp", &layout(ExpertFormat::Bf16)).unwrap_err();
    assert!(
        matches!(e, ModelError::MissingTensor { .. }) && e.to_string().contains("model.layers.7.mlp"),
        "{e}"
    );
}
