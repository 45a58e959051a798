//! GGUF files as models (`open_gguf`), against the Hugging Face directories they were converted
//! from by llama.cpp's own converter (`tests/gguf/NAME-TYPE.gguf`, made by
//! `scripts/gguf/make-model-fixtures.py` from `tests/parity/NAME`): the configuration read from
//! metadata equals the directory's `config.json`; every tensor the graph reads is the
//! directory's tensor with the converter's changes undone, within the file type's rounding
//! (block-quantised matrices held as affine matrices with f32 scales, each value exactly
//! llama.cpp's); and on the CPU the logits match transformers' reference within that rounding
//! (bf16: the directory's own logits, bit for bit).

mod common;

use common::{reference, rel_max_err, top1_agreement, top1_agreement_or_tie};
use kestrel_core::quant::{QuantFormat, QuantMatrix};
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

/// An affine matrix held as `{base}.weight` (u32 words), `.scales` and `.biases` (f32; or, a
/// k-quant's experts, factored: u8 multiples beside f32 units), its rows of `cols` values (every
/// dimension but the last counted as rows).
fn affine(w: &Weights, base: &str, cols: usize) -> QuantMatrix {
    let t = |s: &str| w.get(&format!("{base}.{s}")).unwrap();
    let (wt, st, bt) = (t("weight"), t("scales"), t("biases"));
    let factored = st.dtype == DType::U8;
    assert_eq!(
        (wt.dtype, st.dtype, bt.dtype),
        (
            DType::U32,
            if factored { DType::U8 } else { DType::F32 },
            DType::F32
        ),
        "{base}"
    );
    let words = *wt.shape.last().unwrap();
    let groups = *st.shape.last().unwrap() / if factored { 2 } else { 1 };
    let (bits, group) = ((32 * words / cols) as u32, cols / groups);
    let format = if factored {
        QuantFormat::factored(bits, group)
    } else {
        QuantFormat::f32_scales(bits, group)
    };
    let (scales, biases) = format.group_values(st.bytes, bt.bytes);
    QuantMatrix {
        format,
        rows: wt.shape[..wt.shape.len() - 1].iter().product(),
        cols,
        weight: wt
            .bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        scales,
        biases,
    }
}

/// The values of `name` in `w` and its shape (dimensions of 1 dropped), its rows of `cols`
/// values: a float tensor's as stored; an affine matrix's (`{base}.weight` beside
/// `{base}.scales`) dequantised; an expert's `{mlp}.experts.{e}.{w}_proj.weight` from the
/// stacked `{mlp}.switch_mlp.{w}_proj` when the model holds its experts so.
fn values_of(w: &Weights, name: &str, cols: usize) -> (Vec<usize>, Vec<f32>) {
    if let Some((mlp, rest)) = name.split_once(".experts.") {
        let (e, proj) = rest.split_once('.').unwrap();
        let stacked = format!("{mlp}.switch_mlp.{}", proj.strip_suffix(".weight").unwrap());
        if w.contains(&format!("{stacked}.scales")) {
            let (e, experts) = (
                e.parse::<usize>().unwrap(),
                w.get(&format!("{stacked}.scales")).unwrap().shape[0],
            );
            let v = affine(w, &stacked, cols).dequantize();
            let each = v.len() / experts;
            return (vec![each / cols, cols], v[e * each..(e + 1) * each].to_vec());
        }
    }
    if let Some(base) = name
        .strip_suffix(".weight")
        .filter(|b| w.contains(&format!("{b}.scales")))
    {
        let m = affine(w, base, cols);
        return (vec![m.rows, cols], m.dequantize());
    }
    values(w, name)
}

/// The values of the float tensor `name` of `w`, and its shape (dimensions of 1 dropped).
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
        // A quantised file's matrices are held as an MLX checkpoint's, with its section.
        let q = got.quant.take();
        assert_eq!(q.is_some(), ty == "q8_0", "{name}-{ty}");
        if let Some(q) = q {
            assert_eq!(
                q.format_for("model.embed_tokens"),
                Some(kestrel_core::quant::QuantFormat::f32_scales(8, 32))
            );
        }
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
            let cols = *shape.last().unwrap_or(&1);
            // Stacked experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) against the
            // file's, one an expert.
            let got: Vec<f32> = if let Some(base) = ours.strip_suffix(".experts.gate_up_proj") {
                (0..c.moe.as_ref().unwrap().experts)
                    .flat_map(|e| {
                        let expert = |w| format!("{base}.experts.{e}.{w}_proj.weight");
                        let (_, g) = values_of(&m.weights, &expert("gate"), cols);
                        let (_, u) = values_of(&m.weights, &expert("up"), cols);
                        g.into_iter().chain(u)
                    })
                    .collect()
            } else if let Some(base) = ours.strip_suffix(".experts.down_proj") {
                (0..c.moe.as_ref().unwrap().experts)
                    .flat_map(|e| {
                        values_of(&m.weights, &format!("{base}.experts.{e}.down_proj.weight"), cols).1
                    })
                    .collect()
            } else {
                let (got_shape, got) = values_of(&m.weights, &ours, cols);
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

/// `tests/gguf/dequant.gguf`'s bytes and gguf-py's values of its tensors (`dequant.safetensors`).
fn dequant_fixture() -> (Vec<u8>, Weights) {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let want = std::fs::read(dir.join("dequant.safetensors")).unwrap();
    (
        std::fs::read(dir.join("dequant.gguf")).unwrap(),
        Weights::from_safetensors_bytes("dequant", want).unwrap(),
    )
}

/// Every block-quantised type Kestrel reads, dequantised bit for bit as llama.cpp's own
/// dequantiser (`gguf.quants`) does it, over random blocks (`tests/gguf/dequant.gguf`, by
/// `scripts/gguf/make-dequant-fixture.py`, with the package's values in `dequant.safetensors`).
#[test]
fn dequantisation_equals_llama_cpps() {
    use kestrel_model::gguf::Gguf;
    use kestrel_model::gguf_dequant::dequantize;
    let (bytes, want) = dequant_fixture();
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.tensors.len(), 12);
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

/// Every block-quantised type rewritten as an affine matrix with f32 scales (`to_affine`, how a
/// GGUF file's matrices are held) dequantises to llama.cpp's own values (`dequant.gguf`, as
/// in `dequantisation_equals_llama_cpps`) and to `dequantize`'s, bit for bit, in the format
/// each type maps to. Only a zero's sign may differ: ggml's `(q - z) * d` is -0 where `d < 0`,
/// and `q * d + (-z * d)` is +0.
#[test]
fn affine_matrices_hold_llama_cpps_values_exactly() {
    use kestrel_model::gguf::Gguf;
    use kestrel_model::gguf_dequant::{dequantize, to_affine};
    let (bytes, want) = dequant_fixture();
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.tensors.len(), 12);
    for t in &g.tensors {
        let (rows, cols) = (t.dims[1] as usize, t.dims[0] as usize);
        let m = to_affine(t.ty, t.data(&bytes), rows, cols).unwrap();
        let (bits, group) = match t.name.as_str() {
            "Q4_0" | "Q4_1" | "Q4_K" => (4, 32),
            "Q2_K" | "Q3_K" | "Q6_K" => (8, 16),
            _ => (8, 32),
        };
        assert_eq!(m.format, QuantFormat::f32_scales(bits, group), "{}", t.name);
        let got = m.dequantize();
        for (what, want) in [
            ("gguf-py", values(&want, &t.name).1),
            ("dequantize", dequantize(t.ty, t.data(&bytes)).unwrap()),
        ] {
            assert_eq!(got.len(), want.len(), "{}", t.name);
            let (mut zeros, mut differ) = (0, 0);
            for (a, b) in got.iter().zip(&want) {
                if a.to_bits() != b.to_bits() {
                    if *a == 0.0 && *b == 0.0 {
                        zeros += 1;
                    } else {
                        differ += 1;
                    }
                }
            }
            println!(
                "{}: of {} values, all equal {what}'s bit for bit but {zeros} zeros of the other sign",
                t.name,
                got.len()
            );
            assert_eq!(
                differ,
                0,
                "{}: {differ} of {} values differ from {what}'s",
                t.name,
                got.len()
            );
        }
    }
}

/// The tensors of `w` held in memory rather than read in place from the file.
fn owned(w: &Weights) -> Vec<&str> {
    w.names()
        .into_iter()
        .filter(|n| w.file_span(n).is_none())
        .collect()
}

/// A Q4_K_M file's matrices (the types llama.cpp's quantiser picks for these short rows: Q5_0,
/// Q5_1, Q8_0) load as affine matrices with f32 scales, the gathered (Llama's rotary rows,
/// Qwen3-Next's qkvz, Qwen3.5's value heads) and the experts (MLX's stacked `switch_mlp`) among
/// them: no block-quantised matrix comes back as f32, only vectors and the convolution are
/// held as f32. Prints what the file's quantised tensors take: in the file, as f32 (as they
/// were held before), and as held now.
#[test]
fn q4_k_m_matrices_load_as_f32_scale_quantised_weights() {
    use kestrel_model::gguf::Gguf;
    let q4 = ["llama", "qwen3", "qwen3_moe_all", "qwen3_next", "qwen3_5_moe"];
    for name in q4 {
        let path = gguf(name, "q4_k_m");
        let m = open_gguf(&path).unwrap();
        let w = &m.weights;
        let quant = |base: &str, dims: usize| {
            let (wt, st, bt) = (
                w.get(&format!("{base}.weight")).unwrap(),
                w.get(&format!("{base}.scales")).unwrap(),
                w.get(&format!("{base}.biases")).unwrap(),
            );
            assert_eq!(
                (wt.dtype, st.dtype, bt.dtype, wt.shape.len(), st.shape.len()),
                (DType::U32, DType::F32, DType::F32, dims, dims),
                "{name}: {base}"
            );
        };
        quant("model.embed_tokens", 2);
        let l = |n: &str| format!("model.layers.0.{n}");
        match name {
            "qwen3_next" => {
                quant(&l("linear_attn.in_proj_qkvz"), 2);
                quant(&l("linear_attn.out_proj"), 2);
            }
            "qwen3_5_moe" => {
                // `out_proj` stays f32 here: its value heads of 16 columns move within groups
                // of 32 (`value_heads_move_as_whole_groups` has heads that fill groups).
                for p in ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"] {
                    quant(&l(&format!("linear_attn.{p}")), 2);
                }
            }
            _ => {
                for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                    quant(&l(&format!("self_attn.{p}")), 2);
                }
            }
        }
        if m.config.moe.is_some() {
            for p in ["gate_proj", "up_proj", "down_proj"] {
                quant(&l(&format!("mlp.switch_mlp.{p}")), 3);
            }
            assert!(!w.contains(&l("mlp.experts.0.gate_proj.weight")), "{name}");
        } else {
            quant(&l("mlp.down_proj"), 2);
        }
        let mut now = 0;
        for n in owned(w) {
            let t = w.get(n).unwrap();
            now += t.bytes.len();
            let dims = t.shape.iter().filter(|&&d| d != 1).count();
            let f32_ok = n.ends_with(".scales")
                || n.ends_with(".biases")
                || n.ends_with("conv1d.weight")
                || (name == "qwen3_5_moe" && n.ends_with("out_proj.weight"));
            assert!(
                t.dtype != DType::F32 || dims < 2 || f32_ok,
                "{name}: {n} is held as f32 {:?}",
                t.shape
            );
        }
        let bytes = std::fs::read(&path).unwrap();
        let g = Gguf::parse(&bytes).unwrap();
        let quantised = g
            .tensors
            .iter()
            .filter(|t| !["F32", "F16", "BF16"].contains(&t.ty.name));
        let (file, f32s) = quantised.fold((0, 0), |(a, b), t| (a + t.bytes, b + 4 * t.elem_count()));
        println!(
            "{name}-q4_k_m: quantised tensors take {file} bytes in the file, {f32s} as f32 (before); \
             {now} bytes of tensors are held in memory now"
        );
        assert!(now < f32s as usize, "{name}");
        // Counted as the float file's values (the quantisation section names every matrix).
        let float = open_gguf(&gguf(name, if name == "qwen3" { "bf16" } else { "f16" })).unwrap();
        let (got, want) = (
            kestrel_model::footprint(&m.config, w).unwrap(),
            kestrel_model::footprint(&float.config, &float.weights).unwrap(),
        );
        assert_eq!(
            (got.params, got.active_params),
            (want.params, want.active_params),
            "{name}"
        );
    }
}

/// A metadata value of [`gguf_file`].
enum Kv {
    U32(u32),
    F32(f32),
    Str(&'static str),
}

/// A GGUF file (version 3, alignment 32) holding `kv` and `tensors` (name, dims fastest first,
/// ggml type id, data).
fn gguf_file(kv: &[(&str, Kv)], tensors: &[(String, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        s(&mut b, k);
        match v {
            Kv::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Kv::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Kv::Str(x) => {
                b.extend(8u32.to_le_bytes());
                s(&mut b, x);
            }
        }
    }
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (data.len() as u64).next_multiple_of(32);
    }
    for (_, _, _, data) in tensors {
        b.resize(b.len().next_multiple_of(32), 0);
        b.extend(data);
    }
    b
}

/// A Qwen3-MoE layer whose experts' `down` is Q6_K and `gate` and `up` Q4_K (as Q4_K_M stores
/// many layers) loads each in its own format (gate and up 4 bits in groups of 32, down 8 bits
/// in groups of 16, f32 scales): each matrix's values equal llama.cpp's (`dequantize`); and its
/// logits on the CPU are those of the same file with the experts stored as their f32 values
/// (which the engine packs as bf16: the bound is that rounding's). The same for the types whose
/// values widen to 8 bits (Q2_K, Q3_K, IQ4_NL, IQ4_XS), gate and up of two types brought to one
/// format. q and k beside a v of another type (Q4_K_M's Q6_K `attn_v`) are held in the format
/// common to the three, each value llama.cpp's, so that the graph reads them as one product.
#[test]
fn experts_of_mixed_block_types_load_each_in_its_format() {
    for (gate, up, down, qk, v) in [
        ("Q4_K", "Q4_K", "Q6_K", "Q8_0", "Q8_0"),
        ("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q6_K"),
        ("Q2_K", "Q3_K", "IQ4_XS", "Q8_0", "Q8_0"),
        ("IQ4_NL", "IQ4_XS", "Q3_K", "IQ4_XS", "Q8_0"),
    ] {
        experts_of_types(gate, up, down, [qk, qk, v]);
    }
}

/// `experts_of_mixed_block_types_load_each_in_its_format` for one layer's experts of these
/// types, and q, k and v of the types `qkv`.
fn experts_of_types(gate: &str, up: &str, down: &str, qkv: [&str; 3]) {
    use kestrel_core::rng::Rng;
    use kestrel_model::gguf::GgmlType;
    use kestrel_model::gguf_dequant::{affine_format, common_format, dequantize, factors};
    println!("gate {gate}, up {up}, down {down}; q, k, v {qkv:?}");
    let (hidden, inter, experts, vocab, head) = (256u64, 256u64, 4u64, 32u64, 64u64);
    let ty = |name: &str| {
        (0..40)
            .filter_map(GgmlType::from_id)
            .find(|t| t.name == name)
            .unwrap()
    };
    let (mut rng, seed) = Rng::from_time();
    // Random blocks with their f16 scales between 2^-12 and 2^-9 (at these byte offsets).
    let blocks = |rng: &mut Rng, t: GgmlType, values: u64, scales: &[usize]| -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..values / t.block {
            let mut b: Vec<u8> = (0..t.block_bytes).map(|_| rng.next_u64() as u8).collect();
            for &at in scales {
                let d = (2f32.powi(-12) + rng.next_f32() * 2f32.powi(-9))
                    * if rng.next_u64() % 2 == 0 { 1.0 } else { -1.0 };
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            }
            out.extend(b);
        }
        out
    };
    let mut floats = |n: u64, scale: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|_| (rng.symmetric() * scale).to_le_bytes())
            .collect()
    };
    let f32_ty = 0u32;
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = vec![
        (
            "token_embd.weight".into(),
            vec![hidden, vocab],
            f32_ty,
            floats(hidden * vocab, 1.0),
        ),
        (
            "output_norm.weight".into(),
            vec![hidden],
            f32_ty,
            floats(hidden, 1.0),
        ),
        (
            "blk.0.attn_norm.weight".into(),
            vec![hidden],
            f32_ty,
            floats(hidden, 1.0),
        ),
        (
            "blk.0.ffn_norm.weight".into(),
            vec![hidden],
            f32_ty,
            floats(hidden, 1.0),
        ),
        (
            "blk.0.attn_q.weight".into(),
            vec![hidden, 2 * head],
            f32_ty,
            floats(hidden * 2 * head, 0.1),
        ),
        (
            "blk.0.attn_k.weight".into(),
            vec![hidden, head],
            f32_ty,
            floats(hidden * head, 0.1),
        ),
        (
            "blk.0.attn_v.weight".into(),
            vec![hidden, head],
            f32_ty,
            floats(hidden * head, 0.1),
        ),
        (
            "blk.0.attn_output.weight".into(),
            vec![2 * head, hidden],
            f32_ty,
            floats(2 * head * hidden, 0.1),
        ),
        (
            "blk.0.attn_q_norm.weight".into(),
            vec![head],
            f32_ty,
            floats(head, 1.0),
        ),
        (
            "blk.0.attn_k_norm.weight".into(),
            vec![head],
            f32_ty,
            floats(head, 1.0),
        ),
        (
            "blk.0.ffn_gate_inp.weight".into(),
            vec![hidden, experts],
            f32_ty,
            floats(hidden * experts, 1.0),
        ),
    ];
    // Where each type's f16 scales sit in its blocks.
    let scales_at = |t: &str| -> &[usize] {
        match t {
            "Q2_K" => &[80, 82],
            "Q3_K" => &[108],
            "Q4_K" => &[0, 2],
            "Q6_K" => &[208],
            "IQ4_NL" | "IQ4_XS" | "Q8_0" => &[0],
            _ => panic!("no scales known for {t}"),
        }
    };
    for (p, t) in ["q", "k", "v"].into_iter().zip(qkv) {
        let at = tensors
            .iter()
            .position(|x| x.0 == format!("blk.0.attn_{p}.weight"))
            .unwrap();
        let (scales, t) = (scales_at(t), ty(t));
        tensors[at].3 = blocks(&mut rng, t, tensors[at].1.iter().product(), scales);
        tensors[at].2 = t.id;
    }
    for (w, t, dims) in [
        ("gate", gate, vec![hidden, inter, experts]),
        ("up", up, vec![hidden, inter, experts]),
        ("down", down, vec![inter, hidden, experts]),
    ] {
        let (at, t) = (scales_at(t), ty(t));
        let data = blocks(&mut rng, t, dims.iter().product(), at);
        tensors.push((format!("blk.0.ffn_{w}_exps.weight"), dims, t.id, data));
    }
    let kv = [
        ("general.architecture", Kv::Str("qwen3moe")),
        ("qwen3moe.block_count", Kv::U32(1)),
        ("qwen3moe.context_length", Kv::U32(64)),
        ("qwen3moe.embedding_length", Kv::U32(hidden as u32)),
        ("qwen3moe.feed_forward_length", Kv::U32(inter as u32)),
        ("qwen3moe.attention.head_count", Kv::U32(2)),
        ("qwen3moe.attention.head_count_kv", Kv::U32(1)),
        ("qwen3moe.attention.key_length", Kv::U32(head as u32)),
        ("qwen3moe.attention.layer_norm_rms_epsilon", Kv::F32(1e-6)),
        ("qwen3moe.rope.freq_base", Kv::F32(10000.0)),
        ("qwen3moe.expert_count", Kv::U32(experts as u32)),
        ("qwen3moe.expert_used_count", Kv::U32(2)),
        ("qwen3moe.expert_feed_forward_length", Kv::U32(inter as u32)),
    ];
    let label = std::path::Path::new("mixed.gguf");
    let m = kestrel_model::gguf_from_bytes(label, gguf_file(&kv, &tensors)).unwrap();
    let quantised = tensors.clone();
    let mlp = "model.layers.0.mlp";
    // A k-quant's experts are held with their scales factored; beside another type, as f32.
    let held = |t: &str| {
        let f = affine_format(ty(t)).unwrap();
        if factors(ty(t)) {
            QuantFormat::factored(f.bits, f.group_size)
        } else {
            f
        }
    };
    let gate_up = common_format(&[gate, up].map(held)).unwrap();
    // q, k and v in one format, with their f32 scales.
    let attn = common_format(&qkv.map(|t| affine_format(ty(t)).unwrap())).unwrap();
    for (p, rows) in [("q", 2 * head), ("k", head), ("v", head)] {
        let q = affine(
            &m.weights,
            &format!("model.layers.0.self_attn.{p}_proj"),
            hidden as usize,
        );
        assert_eq!((q.format, q.rows as u64), (attn, rows), "{p}");
        let (_, _, t, data) = tensors
            .iter()
            .find(|t| t.0 == format!("blk.0.attn_{p}.weight"))
            .unwrap();
        let want = dequantize(GgmlType::from_id(*t).unwrap(), data).unwrap();
        assert!(q.dequantize() == want, "seed {seed}: {p}: a value differs");
    }
    for (w, rows, cols, format) in [
        ("gate", inter, hidden, gate_up),
        ("up", inter, hidden, gate_up),
        ("down", hidden, inter, held(down)),
    ] {
        let base = format!("{mlp}.switch_mlp.{w}_proj");
        let q = affine(&m.weights, &base, cols as usize);
        assert_eq!(q.format, format, "{w}");
        assert_eq!(q.rows as u64, experts * rows, "{w}");
        let (_, _, t, data) = tensors
            .iter()
            .find(|t| t.0 == format!("blk.0.ffn_{w}_exps.weight"))
            .unwrap();
        let t = GgmlType::from_id(*t).unwrap();
        let want = dequantize(t, data).unwrap();
        let got = q.dequantize();
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ,
            0,
            "seed {seed}: {w}: {differ} of {} values differ",
            got.len()
        );
        // The same values as f32 experts, for the logits below.
        let at = tensors
            .iter()
            .position(|t| t.0 == format!("blk.0.ffn_{w}_exps.weight"))
            .unwrap();
        tensors[at].2 = f32_ty;
        tensors[at].3 = want.iter().flat_map(|v| v.to_le_bytes()).collect();
    }
    let tokens = [1, 7, 30, 2, 19, 5];
    let got = cpu_logits(m, &tokens);
    let f = kestrel_model::gguf_from_bytes(label, gguf_file(&kv, &tensors)).unwrap();
    assert!(f.weights.contains(&format!("{mlp}.experts.0.down_proj.weight")));
    let want = cpu_logits(f, &tokens);
    let err = rel_max_err(&got, &want);
    println!("mixed experts: max |error| / max |logit| against f32 experts (packed as bf16) {err:.2e}");
    assert!(
        got.iter().all(|v| v.is_finite()) && err <= 2e-2,
        "seed {seed}: error {err:.2e}"
    );
    // Gate and up of one type fused into one tensor, and q, k and v, as llama.cpp's converter
    // writes them with `--fuse-gate-up-exps` and `--fuse-qkv`: the same logits, bit for bit,
    // with quantised and with f32 experts.
    if gate == up && qkv.iter().all(|&t| t == qkv[0]) {
        for (what, tensors, want) in [("quantised", &quantised, &got), ("f32", &tensors, &want)] {
            let fused = fuse_qkv(&fuse_gate_up(tensors));
            let fused = kestrel_model::gguf_from_bytes(label, gguf_file(&kv, &fused)).unwrap();
            assert_eq!(
                &cpu_logits(fused, &tokens),
                want,
                "{what} experts, gate and up fused"
            );
        }
        // Fused tensors that cannot be split are errors naming them: q, k and v of no q rows,
        // and gate and up of an odd number of rows an expert.
        let fused = fuse_qkv(&fuse_gate_up(&quantised));
        let at = |n: &str| fused.iter().position(|t| t.0 == n).unwrap();
        let mut no_q = fused.clone();
        let qkv = &mut no_q[at("blk.0.attn_qkv.weight")];
        let row = qkv.3.len() / qkv.1[1] as usize;
        qkv.1[1] = 2 * head;
        qkv.3.truncate(2 * head as usize * row);
        let mut odd = fused.clone();
        let gu = &mut odd[at("blk.0.ffn_gate_up_exps.weight")];
        let each = gu.3.len() / experts as usize;
        let row = each / (2 * inter) as usize;
        gu.1[1] -= 1;
        gu.3 =
            gu.3.chunks_exact(each)
                .flat_map(|e| e[..each - row].to_vec())
                .collect();
        for (tensors, name) in [(no_q, "attn_qkv"), (odd, "ffn_gate_up_exps")] {
            let e = kestrel_model::gguf_from_bytes(label, gguf_file(&kv, &tensors))
                .err()
                .expect("an error");
            assert!(e.to_string().contains(name), "{e}");
        }
    }
}

/// `tensors` with layer 0's `attn_q`, `attn_k` and `attn_v` (`[rows, cols]` each, one type) as
/// one `blk.0.attn_qkv.weight`, their rows in that order (llama.cpp's `--fuse-qkv`).
fn fuse_qkv(tensors: &[(String, Vec<u64>, u32, Vec<u8>)]) -> Vec<(String, Vec<u64>, u32, Vec<u8>)> {
    let names = ["q", "k", "v"].map(|p| format!("blk.0.attn_{p}.weight"));
    let parts = names
        .clone()
        .map(|n| tensors.iter().find(|t| t.0 == n).unwrap().clone());
    let mut out: Vec<_> = tensors
        .iter()
        .filter(|t| !names.contains(&t.0))
        .cloned()
        .collect();
    out.push((
        "blk.0.attn_qkv.weight".into(),
        vec![parts[0].1[0], parts.iter().map(|p| p.1[1]).sum()],
        parts[0].2,
        parts.iter().flat_map(|p| p.3.clone()).collect(),
    ));
    out
}

/// `tensors` with layer 0's expert gate and up (`[experts, rows, cols]` each) as one
/// `blk.0.ffn_gate_up_exps.weight` of `[experts, 2 * rows, cols]`, each expert's gate rows
/// before its up rows (llama.cpp's `torch.cat([gate, up], dim=1)`).
fn fuse_gate_up(tensors: &[(String, Vec<u64>, u32, Vec<u8>)]) -> Vec<(String, Vec<u64>, u32, Vec<u8>)> {
    let find = |n: &str| tensors.iter().find(|t| t.0 == n).unwrap().clone();
    let (gate, up) = (
        find("blk.0.ffn_gate_exps.weight"),
        find("blk.0.ffn_up_exps.weight"),
    );
    assert_eq!((&gate.1, gate.2), (&up.1, up.2));
    let experts = gate.1[2] as usize;
    let each = gate.3.len() / experts;
    let data = (0..experts)
        .flat_map(|e| [&gate.3[e * each..(e + 1) * each], &up.3[e * each..(e + 1) * each]].concat())
        .collect();
    let mut out: Vec<_> = tensors
        .iter()
        .filter(|t| t.0 != gate.0 && t.0 != up.0)
        .cloned()
        .collect();
    out.push((
        "blk.0.ffn_gate_up_exps.weight".into(),
        vec![gate.1[0], 2 * gate.1[1], gate.1[2]],
        gate.2,
        data,
    ));
    out
}

/// A Qwen3.5-MoE linear-attention layer whose value heads fill whole groups (32 columns): its
/// Q8_0 matrices whose rows or columns the mapping reorders (`in_proj_qkv`, `in_proj_z`,
/// `in_proj_b`, `in_proj_a` by rows, `out_proj` by columns) load as affine matrices holding
/// the values the same file with those matrices stored as f32 gives, and the logits on the CPU
/// are that file's (within the rounding of the products' different order).
#[test]
fn value_heads_move_as_whole_groups() {
    use kestrel_core::rng::Rng;
    use kestrel_model::gguf::GgmlType;
    use kestrel_model::gguf_dequant::dequantize;
    let (hidden, vocab, experts, inter) = (64u64, 32u64, 4u64, 32u64);
    let (nk, hk, nv, hv) = (2u64, 32u64, 4u64, 32u64);
    let (qkv, v_dim) = (2 * nk * hk + nv * hv, nv * hv);
    let (mut rng, seed) = Rng::from_time();
    let f32_ty = 0u32;
    let mut floats = |name: &str, dims: Vec<u64>, f: &dyn Fn(f32) -> f32| {
        let data = (0..dims.iter().product::<u64>())
            .flat_map(|_| f(rng.symmetric()).to_le_bytes())
            .collect();
        (name.to_string(), dims, f32_ty, data)
    };
    let small = |x: f32| 0.1 * x;
    let one = |x: f32| 1.0 + 0.1 * x;
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = vec![
        floats("token_embd.weight", vec![hidden, vocab], &|x| x),
        floats("output_norm.weight", vec![hidden], &one),
        floats("blk.0.attn_norm.weight", vec![hidden], &one),
        floats("blk.0.post_attention_norm.weight", vec![hidden], &one),
        floats("blk.0.ssm_a", vec![nv], &|x: f32| -(0.5 + x.abs())),
        floats("blk.0.ssm_norm.weight", vec![hv], &one),
        floats("blk.0.ssm_dt.bias", vec![nv], &small),
        floats("blk.0.ssm_conv1d.weight", vec![4, qkv], &|x| x),
        floats("blk.0.ffn_gate_inp.weight", vec![hidden, experts], &|x| x),
        floats("blk.0.ffn_gate_exps.weight", vec![hidden, inter, experts], &small),
        floats("blk.0.ffn_up_exps.weight", vec![hidden, inter, experts], &small),
        floats("blk.0.ffn_down_exps.weight", vec![inter, hidden, experts], &small),
        floats("blk.0.ffn_gate_inp_shexp.weight", vec![hidden], &|x| x),
        floats("blk.0.ffn_gate_shexp.weight", vec![hidden, inter], &small),
        floats("blk.0.ffn_up_shexp.weight", vec![hidden, inter], &small),
        floats("blk.0.ffn_down_shexp.weight", vec![inter, hidden], &small),
    ];
    // Q8_0 blocks: an f16 scale between 2^-12 and 2^-8, 32 random signed bytes.
    let q8 = (0..40)
        .filter_map(GgmlType::from_id)
        .find(|t| t.name == "Q8_0")
        .unwrap();
    let reordered = [
        ("blk.0.attn_qkv.weight", vec![hidden, qkv]),
        ("blk.0.attn_gate.weight", vec![hidden, v_dim]),
        ("blk.0.ssm_beta.weight", vec![hidden, nv]),
        ("blk.0.ssm_alpha.weight", vec![hidden, nv]),
        ("blk.0.ssm_out.weight", vec![v_dim, hidden]),
    ];
    for (name, dims) in &reordered {
        let mut data = Vec::new();
        for _ in 0..dims.iter().product::<u64>() / 32 {
            let d = 2f32.powi(-12) + rng.next_f32() * 2f32.powi(-8);
            data.extend(half::f16::from_f32(d).to_le_bytes());
            data.extend((0..32).map(|_| rng.next_u64() as u8));
        }
        tensors.push((name.to_string(), dims.clone(), q8.id, data));
    }
    let u = |k: &'static str, v: u64| (k, Kv::U32(v as u32));
    let kv = [
        ("general.architecture", Kv::Str("qwen35moe")),
        u("qwen35moe.block_count", 1),
        u("qwen35moe.context_length", 64),
        u("qwen35moe.embedding_length", hidden),
        u("qwen35moe.attention.head_count", 2),
        u("qwen35moe.attention.head_count_kv", 1),
        u("qwen35moe.attention.key_length", 32),
        ("qwen35moe.attention.layer_norm_rms_epsilon", Kv::F32(1e-6)),
        u("qwen35moe.expert_count", experts),
        u("qwen35moe.expert_used_count", 2),
        u("qwen35moe.expert_feed_forward_length", inter),
        u("qwen35moe.expert_shared_feed_forward_length", inter),
        u("qwen35moe.ssm.time_step_rank", nv),
        u("qwen35moe.ssm.inner_size", v_dim),
        u("qwen35moe.ssm.conv_kernel", 4),
        u("qwen35moe.ssm.state_size", hk),
        u("qwen35moe.ssm.group_count", nk),
    ];
    let label = std::path::Path::new("heads.gguf");
    let m = kestrel_model::gguf_from_bytes(label, gguf_file(&kv, &tensors)).unwrap();
    // The same file with the reordered matrices as their f32 values.
    for (name, _) in &reordered {
        let t = tensors.iter_mut().find(|t| t.0 == *name).unwrap();
        let v = dequantize(GgmlType::from_id(t.2).unwrap(), &t.3).unwrap();
        t.2 = f32_ty;
        t.3 = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    }
    let f = kestrel_model::gguf_from_bytes(label, gguf_file(&kv, &tensors)).unwrap();
    for p in ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"] {
        let name = format!("model.layers.0.linear_attn.{p}.weight");
        let (shape, want) = values(&f.weights, &name);
        assert_eq!(m.weights.get(&name).unwrap().dtype, DType::U32, "{p}");
        let (got_shape, got) = values_of(&m.weights, &name, *shape.last().unwrap());
        assert_eq!(got_shape, shape, "{p}");
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ,
            0,
            "seed {seed}: {p}: {differ} of {} values differ",
            got.len()
        );
    }
    let tokens = [1, 7, 30, 2, 19, 5];
    let (got, want) = (cpu_logits(m, &tokens), cpu_logits(f, &tokens));
    let err = rel_max_err(&got, &want);
    println!("value heads: max |error| / max |logit| against the f32 file {err:.2e}");
    assert!(err <= 1e-4, "seed {seed}: error {err:.2e}");
}

/// A GGUF file's block-quantised experts (MLX's stacked `switch_mlp`, f32 scales) stream
/// through caches of slots as a directory's do: on the CPU, served from host memory by the
/// graph, by the host from the model's memory, or some of each, the logits are the resident
/// session's bit for bit.
#[test]
fn quantised_gguf_experts_stream_as_they_run_resident() {
    use kestrel_model::{Eviction, StageAhead};
    for ty in ["q8_0", "q4_k_m"] {
        let (tokens, _, _) = reference("qwen3_moe_all");
        let session = || {
            let m = open_gguf(&gguf("qwen3_moe_all", ty)).unwrap();
            assert!(m
                .weights
                .contains("model.layers.0.mlp.switch_mlp.gate_proj.scales"));
            Session::new(m.config, m.weights, CpuBackend::new(), 64, DType::F32)
                .with_prefill_chunk(Some(5))
                .unwrap()
        };
        let run = |s: &mut Session<CpuBackend>| {
            let mut out = s
                .step(&tokens, 0, Want::AllLogits)
                .unwrap()
                .into_logits()
                .unwrap();
            for (i, &t) in tokens.iter().rev().take(4).enumerate() {
                out.extend(
                    s.step(&[t], tokens.len() + i, Want::LastLogits)
                        .unwrap()
                        .into_logits()
                        .unwrap(),
                );
            }
            out
        };
        let want = run(&mut session());
        let k = open_gguf(&gguf("qwen3_moe_all", ty))
            .unwrap()
            .config
            .moe
            .unwrap()
            .experts_per_token;
        for host_layers in [usize::MAX, 1, 0] {
            let mut s = session()
                .with_expert_cache(k, Eviction::Lru)
                .unwrap()
                .with_host_layers(host_layers)
                .with_stage_ahead(StageAhead::On);
            assert!(
                run(&mut s) == want,
                "{ty}, {host_layers} host layers: logits differ"
            );
            let stats = s.expert_stats().unwrap().unwrap();
            assert!(stats.misses > 0 && stats.evictions > 0, "{ty}: {stats:?}");
        }
    }
}

/// Every GGUF fixture on CUDA (graph replay), the Q4_K_M and IQ4_NL files among them: with every rounding
/// fast path off and f32 caches, prefill and token-by-token decode equal the CPU's logits of
/// the same file (max |error| / max |logit| <= 1e-4), except where the experts are quantised,
/// which CUDA runs on rounded activations whatever the setting (then held to the default
/// paths' check); with the default fast paths, top-1
/// agreement with the CPU is reported and at least 75% (the hybrids' random routers have near
/// ties that bf16 activations flip, as for their directories in `parity_cuda`). Skips with a
/// notice without a CUDA device.
#[test]
fn gguf_models_run_on_cuda_as_on_the_cpu() {
    use kestrel_cuda::{CudaBackend, Exact, RunMode};
    let Some(dev) = kestrel_testing::gpu::device_or_skip("gguf_models_run_on_cuda_as_on_the_cpu") else {
        return;
    };
    // The Q4_K_M and IQ4_NL files too: what llama.cpp's quantiser picks for rows this short.
    let names = ["llama", "qwen3", "qwen3_moe_all", "qwen3_next", "qwen3_5_moe"];
    let quantised = ["q4_k_m", "iq4_nl"]
        .into_iter()
        .flat_map(|ty| names.map(|n| (n, ty)));
    for (name, ty) in CASES.into_iter().chain(quantised) {
        let (tokens, _, _) = reference(name);
        let m = open_gguf(&gguf(name, ty)).unwrap();
        // Quantised experts (stacked as `switch_mlp`) have no f32-activation kernel: CUDA runs
        // them on int8 (few tokens) or bf16 (many) activations even with rounding switched off.
        let quantised_experts = m.weights.names().iter().any(|n| n.contains(".switch_mlp."));
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
                if exact && !quantised_experts {
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

/// A file whose quantised tensors would not fit in memory as Kestrel holds them (8-bit values
/// with f32 scales for Q8_0) is refused before anything is converted, with the sizes named (a
/// sparse file: a header and 1 TiB of Q8_0 blocks).
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
    assert!(
        e.contains("1024.0 GiB in the file")
            && e.contains("1204.7 GiB as Kestrel holds them")
            && e.contains("available"),
        "{e}"
    );
}

/// Kestrel's logits on the CPU against llama.cpp's own on the same files (every
/// `NAME-TYPE.llama.safetensors` of `tests/gguf/`, by `scripts/gguf/make-quant-fixtures.py`: the
/// float and Q8_0 conversions, and Q4_K_M and IQ4_NL files quantised by llama.cpp). llama.cpp rounds
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

/// Files whose experts' gate and up, and whose full-attention layers' q, k and v, are fused as
/// llama.cpp's converter writes them with `--fuse-gate-up-exps --fuse-qkv` (`NAME-fused.gguf`,
/// by `scripts/gguf/make-fused-fixtures.py` with llama.cpp's own writer; the hybrids, whose
/// linear-attention layers have an `attn_qkv` of their own): the logits of the files they come
/// from, bit for bit, on the CPU.
#[test]
fn fused_files_give_the_unfused_files_logits() {
    let tokens = [1, 17, 42, 99, 3, 250, 128, 64];
    for name in ["qwen3_next", "qwen3_5_moe"] {
        let plain = open_gguf(&gguf(name, "q8_0")).unwrap();
        let fused = open_gguf(&gguf(name, "q8_0-fused")).unwrap();
        assert!(fused.weights.contains("model.layers.3.self_attn.q_proj.weight"));
        assert_eq!(cpu_logits(fused, &tokens), cpu_logits(plain, &tokens), "{name}");
    }
}

/// A router llama.cpp's converter wrote as f32 from a bf16 checkpoint is held as bf16 (every
/// value the file's), and one value that is no bf16 keeps the whole router in f32.
#[test]
fn routers_of_bf16_values_are_held_as_bf16() {
    use kestrel_model::gguf::Gguf;
    let path = gguf("qwen3_moe_all", "q8_0");
    let mut bytes = std::fs::read(&path).unwrap();
    let (start, len) = {
        let g = Gguf::parse(&bytes).unwrap();
        let t = g
            .tensors
            .iter()
            .find(|t| t.name == "blk.0.ffn_gate_inp.weight")
            .unwrap();
        assert_eq!(t.ty.name, "F32");
        (t.start as usize, t.bytes as usize)
    };
    let file: Vec<f32> = bytes[start..start + len]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let name = "model.layers.0.mlp.gate.weight";
    let m = kestrel_model::gguf_from_bytes(&path, bytes.clone()).unwrap();
    let t = m.weights.get(name).unwrap();
    assert_eq!(t.dtype, DType::BF16);
    let held: Vec<f32> = t
        .bytes
        .chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect();
    assert!(held == file, "a bf16 router value differs from the file's");
    // The last value's lowest bit set: no longer a bf16.
    bytes[start + len - 4] |= 1;
    let m = kestrel_model::gguf_from_bytes(&path, bytes).unwrap();
    let t = m.weights.get(name).unwrap();
    assert_eq!(t.dtype, DType::F32);
    let last = f32::from_le_bytes(t.bytes[len - 4..].try_into().unwrap());
    assert_eq!(last.to_bits(), file[file.len() - 1].to_bits() | 1);
}
