//! Skinny tensor-core products (`kernels/skinny.cu`): a few rows of activations against 4- or
//! 8-bit weights, each weight read once straight into registers. `linear.rs` runs quantised
//! projections of 2 to `LINEAR_MAX_TOKENS` tokens through them (on Hopper, from
//! `WIDE_LINEAR_MIN_TOKENS` on their wgmma form), `moe.rs` the routed experts of batched decode
//! steps and short chunks (tiles of `moe_sort`'s table of 8, 16 or 32 rows, or the wgmma form's
//! 16 to 64).

use kestrel_core::ir::{ExpertFormat, ExpertLayout, MatrixSpan};
use kestrel_core::quant::{QuantFormat, ScaleType};
use kestrel_core::DType;

use kestrel_cuda_rt::{Buffer, ModuleSource, Result};

use super::common::{
    k_splits, op_module, quant_name, quant_parts_aligned, split_args, split_scratch, u32_arg, unsupported,
};
use crate::encoder::Encoder;

/// Warps of a block.
const SK_WARPS: usize = 4;
/// K values a stage of the wide kernels takes, and the stages a block holds in shared memory
/// (`WS_STAGE`, `WS_STAGES` in skinny.cu, which are these).
const WIDE_STAGE: usize = 128;
const WIDE_STAGES: usize = 4;
/// The skinny experts' gate/up of up to this many row tiles of 8 reads its activations from
/// shared memory, where each block first copies its tile's rows (`SK_STAGED_NT`), each row
/// `STAGE_PAD` values longer than K there (`SK_STAGE_PAD`; see `skinny_block` in skinny.cu).
const STAGED_TILES: usize = 1;
const STAGE_PAD: usize = 32;

/// `skinny.cu` as the module `name`: part `SK_PART` of its kernels, for the experts' formats of
/// scale type `SK_SCALE` (see the file's head).
macro_rules! skinny_module {
    ($name:literal, $part:literal, $scale:literal) => {
        op_module(
            $name,
            include_str!("../../kernels/skinny.cu"),
            &[
                ("SK_WARPS", SK_WARPS as i64),
                ("WS_STAGE", WIDE_STAGE as i64),
                ("WS_STAGES", WIDE_STAGES as i64),
                ("SK_PART", $part),
                ("SK_SCALE", $scale),
                ("SK_STAGED_NT", STAGED_TILES as i64),
                ("SK_STAGE_PAD", STAGE_PAD as i64),
            ],
        )
    };
}

/// `skinny.cu`'s modules, compiled side by side on a first start (one module of all its kernels
/// took 65-74 s on the H200's host, the wide experts alone about half of that): the skinny and
/// the wide experts, each a module a scale type (`expert_module`), and the projections with the
/// activations' layouts (`PROJECTIONS`).
pub(crate) const MODULES: [ModuleSource; 7] = [
    skinny_module!("skinny.experts_bf16", 1, 0),
    skinny_module!("skinny.experts_f32", 1, 1),
    skinny_module!("skinny.experts_factored", 1, 2),
    skinny_module!("skinny.wide_bf16", 2, 0),
    skinny_module!("skinny.wide_f32", 2, 1),
    skinny_module!("skinny.wide_factored", 2, 2),
    PROJECTIONS,
];

/// The projections (`linear_skinny_*`, `linear_wide_*`) and the kernels that write activations in
/// the experts' layouts (`skinny_permute_x_*`, `wide_permute_*`).
const PROJECTIONS: ModuleSource = skinny_module!("skinny.projections", 3, 0);

/// The module of the skinny (or with `wide`, the wide) experts' kernels of a matrix in `format`.
pub(crate) fn expert_module(format: &QuantFormat, wide: bool) -> &'static ModuleSource {
    let scale = match format.scale {
        ScaleType::Bf16 => 0,
        ScaleType::F32 => 1,
        ScaleType::Factored => 2,
    };
    &MODULES[3 * wide as usize + scale]
}

/// Up to this many tokens, quantised projections run skinny; from there on, as `gemm.cu`'s tiles.
/// Measured on the H200 at Qwen3-30B-A3B's shapes: a batched step of 128 sequences 10% faster
/// skinny (4 tiles of 32 rows), one of 256 8% slower (the lm_head alone 1.56 ms against 0.39).
pub(crate) const LINEAR_MAX_TOKENS: usize = 128;

/// Values of a row one lane loads at once (16 bytes), and of a run of four lanes: the K step,
/// which the reduction dimension must be a multiple of.
fn lane_values(bits: u32) -> usize {
    128 / bits as usize
}

/// Whether a 4- or 8-bit matrix of `k` values a row, grouped by `group`, fits the kernels: whole
/// runs of K, each lane's values inside one group.
fn quant_fits(bits: u32, group: usize, k: usize) -> bool {
    (bits == 4 || bits == 8)
        && k % (4 * lane_values(bits)) == 0
        && group % lane_values(bits) == 0
        && k % group == 0
}

/// Warps along K per group of 16 features: 4 when the product has too few (features / 16 x row
/// tiles) warps to keep every SM busy with 8, else 1.
fn k_shares(enc: &Encoder, features: usize, tiles: usize) -> usize {
    let warps = features.div_ceil(16) * tiles;
    if warps < 8 * enc.device.info().sm_count as usize {
        4
    } else {
        1
    }
}

/// Row tiles of 8 per warp for the routed experts of `slots` (token, expert) pairs over `experts`:
/// by the rows an expert gets on average, or None when there are enough for the tiles of
/// `gemm.cu` (more than 24 on average).
pub(crate) fn moe_row_tiles(slots: usize, experts: usize) -> Option<usize> {
    let mean = slots as f64 / experts.max(1) as f64;
    match mean {
        m if m <= 4.0 => Some(1),
        m if m <= 10.0 => Some(2),
        m if m <= 24.0 => Some(4),
        _ => None,
    }
}

/// Whether the experts fit the skinny kernels: quantised to 4 or 8 bits in whole runs of K both
/// ways (gate and up over hidden values, down over inter), every matrix of a span 16-byte
/// aligned, and x read as float4s.
pub(crate) fn moe_fits(layout: &ExpertLayout, experts: &Buffer, x: &Buffer) -> bool {
    let [ExpertFormat::Quant(q), ExpertFormat::Quant(qd)] = layout.formats() else {
        return false;
    };
    let (h, i) = (layout.hidden, layout.inter);
    let aligned = |m: MatrixSpan, f: QuantFormat| {
        let size = f.scale.size_in_bytes();
        // Factored units are read as f32 pairs.
        let units = if f.scale == ScaleType::Factored { 8 } else { size };
        m.weight % 16 == 0 && m.scales % size == 0 && m.biases % units == 0
    };
    layout.span_bytes() % 16 == 0
        && experts.device_ptr() % 16 == 0
        && x.device_ptr() % 16 == 0
        && aligned(layout.gate(), q)
        && aligned(layout.up(), q)
        && aligned(layout.down_span(), qd)
        && quant_fits(q.bits, q.group_size, h)
        && quant_fits(qd.bits, qd.group_size, i)
        && h % 16 == 0
        && i % 16 == 0
}

/// The skinny kernel `<kernel>_<format>_<nt>_<ks>` (format `q4`, `q8f`, ...: `quant_name`) and
/// its grid's x for `features` output rows, `tiles` row tiles.
pub(crate) fn launch(
    enc: &Encoder,
    kernel: &str,
    format: &str,
    nt: usize,
    features: usize,
    tiles: usize,
) -> (String, usize) {
    let ks = k_shares(enc, features, tiles);
    (
        format!("{kernel}_{format}_{nt}_{ks}"),
        features.div_ceil(16 * SK_WARPS / ks),
    )
}

/// Dynamic shared memory of a skinny gate/up block of `nt` row tiles over `k` values: its rows of
/// activations where they are staged there, else none.
pub(crate) const fn staged_smem(nt: usize, k: usize) -> usize {
    match nt <= STAGED_TILES {
        true => 8 * nt * (k + STAGE_PAD) * 2,
        false => 0,
    }
}

/// Dynamic shared memory of a wide block of `rows` rows: the stages' slots and room to align them
/// to 1024 bytes (they also hold gate/up's hand-over of up's products at the end).
pub(crate) const fn wide_smem(rows: usize) -> usize {
    WIDE_STAGES * rows * WIDE_STAGE * 2 + 1024
}

/// Rows of the wide (wgmma) tiles for the routed experts of `slots` (token, expert) pairs over
/// `experts`, by the rows an expert gets on average, or None where the skinny products (up to 4)
/// or `gemm.cu`'s tiles (beyond 48) take them. Measured on an H100 at Qwen3-30B-A3B's shapes,
/// against those: batched steps of 128 and 256 sequences 5% and 11% faster, prefill of 256 and
/// 512 tokens 12.5% and 2%; 64 sequences (4 rows) 2% slower, 1,024 tokens (64 rows) 7% slower.
/// Tiles of 64 from 32 to 48 rows on the H200, against the GEMM tiles: a prefill alone 1.2%
/// faster at 576 tokens, 2.0% and 2.5% slower at 640 and 768, but the server's mixed steps (64 or
/// 256 sequences' next tokens beside a 512-token chunk: 36 and 48 rows) gained 8-10% and 13% of
/// output tokens a second (`bench serve`, two runs each way), for reasons not yet measured.
pub(crate) fn moe_wide_rows(slots: usize, experts: usize) -> Option<usize> {
    let mean = slots as f64 / experts.max(1) as f64;
    match mean {
        m if m <= 4.0 => None,
        m if m <= 10.0 => Some(16),
        m if m <= 24.0 => Some(32),
        m if m <= 48.0 => Some(64),
        _ => None,
    }
}

/// Whether the experts fit the wide kernels (Hopper only): as `moe_fits`, with both dimensions
/// in whole stages (which are whole 64-feature blocks too).
pub(crate) fn moe_wide_fits(enc: &Encoder, layout: &ExpertLayout, experts: &Buffer, x: &Buffer) -> bool {
    enc.device.wide_experts()
        && moe_fits(layout, experts, x)
        && layout.hidden % WIDE_STAGE == 0
        && layout.inter % WIDE_STAGE == 0
}

/// x (`[rows, k]`, 16-byte aligned) rounded to bf16 in the layout the kernels of `bits`-bit
/// weights read: `px_index` in skinny.cu for the skinny products (x f32), `pw_index` for the
/// wide ones (x f32, or bf16 for the projections).
pub(crate) fn permuted_x(
    enc: &mut Encoder,
    x: &Buffer,
    (rows, k): (usize, usize),
    bits: u32,
    wide: bool,
) -> Result<Buffer> {
    let name = match (x.dtype(), wide) {
        (DType::F32, false) => format!("skinny_permute_x_q{bits}"),
        (DType::F32, true) => format!("wide_permute_x_q{bits}"),
        (DType::BF16, true) => format!("wide_permute_bf16_q{bits}"),
        (dtype, _) => {
            return Err(unsupported(format!(
                "{dtype:?} activations in the {} products' layout",
                if wide { "wide" } else { "skinny" }
            )))
        }
    };
    let out = enc.workspace(DType::BF16, [rows, k])?;
    let kern = enc.kernel(&PROJECTIONS, &name)?;
    enc.dispatch(&kern)
        .cover(rows * k / 8, 256)
        .read(x)
        .write(&out)
        .arg(u32_arg(rows)?)
        .arg(u32_arg(k)?)
        .record();
    Ok(out)
}

/// Threads of a block.
pub(crate) const THREADS: u32 = 32 * SK_WARPS as u32;

/// Whether a projection of `tokens` tokens with a `format` weight (its words, scales and biases
/// `parts`) runs skinny: 2 to `LINEAR_MAX_TOKENS` tokens, whole runs of K, 16 outputs at a time,
/// 16-byte loads of the words and loads of the scales and biases in their own type.
pub(crate) fn linear_fits(
    format: QuantFormat,
    tokens: usize,
    (in_dim, out_dim): (usize, usize),
    parts: &[Buffer],
) -> bool {
    (2..=LINEAR_MAX_TOKENS).contains(&tokens)
        && quant_fits(format.bits, format.group_size, in_dim)
        && out_dim % 16 == 0
        && quant_parts_aligned(&format, parts)
}

/// From this many tokens, projections `linear_fits` accepts run on wgmma (`linear_wide_*`) where
/// `linear_wide_fits` says so. Measured on the H200 at Qwen3-30B-A3B's shapes against the skinny
/// products (the whole model's batched decode step): 32 sequences 4.6% slower, 64 3.6% faster
/// (the lm_head 150 µs against 393; each projection about the same with the copy of x), 128
/// 13.6% faster (the skinny products read the weights once per tile of 32 rows).
pub(crate) const WIDE_LINEAR_MIN_TOKENS: usize = 33;
/// Rows of `linear_wide_*`'s token tiles.
const WIDE_LINEAR_ROWS: usize = 64;
/// The most ranges `linear_wide_*` splits K into, and the fewest stages each range takes.
const WIDE_MAX_SPLITS: usize = 8;
const WIDE_MIN_SPLIT_STAGES: usize = 2;

/// Whether a projection `linear_fits` accepts runs on wgmma: Hopper with the wide projections on,
/// `WIDE_LINEAR_MIN_TOKENS` or more tokens, K in whole stages and the outputs in blocks of 64.
fn linear_wide_fits(enc: &Encoder, tokens: usize, (in_dim, out_dim): (usize, usize)) -> bool {
    enc.device.wide_projections()
        && tokens >= WIDE_LINEAR_MIN_TOKENS
        && in_dim % WIDE_STAGE == 0
        && out_dim % 64 == 0
}

/// `encode_linear` where `linear_wide_fits`: x copied into the wgmma form's layout, then
/// `linear_wide_*`, K split while the split blocks stay within three a multiprocessor (the most
/// their shared memory lets one hold).
fn encode_linear_wide(
    enc: &mut Encoder,
    xb: &Buffer,
    (format, parts): (QuantFormat, &[Buffer]),
    out: &Buffer,
    (tokens, in_dim, out_dim): (usize, usize, usize),
) -> Result<()> {
    let xp = permuted_x(enc, xb, (tokens, in_dim), format.bits, true)?;
    let (row_tiles, col_tiles) = (tokens.div_ceil(WIDE_LINEAR_ROWS), out_dim / 64);
    let tiles = row_tiles * col_tiles;
    let sms = enc.device.info().sm_count as usize;
    let stages = in_dim / WIDE_STAGE;
    let splits = k_splits(tiles, stages, 3 * sms, WIDE_MAX_SPLITS, WIDE_MIN_SPLIT_STAGES);
    let scratch = split_scratch(enc, splits, tiles, WIDE_LINEAR_ROWS * 64)?;
    let k = enc.kernel(&PROJECTIONS, &format!("linear_wide_{}", quant_name(&format)?))?;
    let b = enc
        .dispatch(&k)
        .grid((u32_arg(col_tiles)?, u32_arg(row_tiles)?, u32_arg(splits)?))
        .block(128)
        .shared_mem(u32_arg(wide_smem(WIDE_LINEAR_ROWS))?)
        .read(&xp)
        .read(&parts[0])
        .read(&parts[1])
        .read(&parts[2])
        .write(out);
    split_args(b, &scratch)
        .arg(u32_arg(tokens)?)
        .arg(u32_arg(in_dim)?)
        .arg(u32_arg(out_dim)?)
        .arg(u32_arg(format.group_size)?)
        .record();
    Ok(())
}

/// `out = x W^T` on the bf16 activations `xb` for a weight `linear_fits` accepts: on wgmma
/// where `linear_wide_fits`, else on the skinny products.
pub(crate) fn encode_linear(
    enc: &mut Encoder,
    xb: &Buffer,
    (format, parts): (QuantFormat, &[Buffer]),
    out: &Buffer,
    (tokens, in_dim, out_dim): (usize, usize, usize),
) -> Result<()> {
    if linear_wide_fits(enc, tokens, (in_dim, out_dim)) {
        return encode_linear_wide(enc, xb, (format, parts), out, (tokens, in_dim, out_dim));
    }
    // Up to 32 rows a tile: beyond, the activations a warp reads per weight outgrow what L1
    // delivers.
    let nt = [1, 2, 4].into_iter().find(|&n| tokens <= 8 * n).unwrap_or(4);
    let tiles = tokens.div_ceil(8 * nt);
    let (name, grid_x) = launch(enc, "linear_skinny", quant_name(&format)?, nt, out_dim, tiles);
    let k = enc.kernel(&PROJECTIONS, &name)?;
    enc.dispatch(&k)
        .grid((u32_arg(grid_x)?, u32_arg(tiles)?))
        .block(THREADS)
        .read(xb)
        .read(&parts[0])
        .read(&parts[1])
        .read(&parts[2])
        .write(out)
        .arg(u32_arg(tokens)?)
        .arg(u32_arg(in_dim)?)
        .arg(u32_arg(out_dim)?)
        .arg(u32_arg(format.group_size)?)
        .record();
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use kestrel_core::Config;
    use kestrel_cuda_rt::{compile_module, cubin_has_function, CudaError, ModuleSource};
    use kestrel_testing::cases::{FACTORED_FORMATS, QUANT_FORMATS};

    use super::{expert_module, quant_name, MODULES, PROJECTIONS};

    /// Every kernel the host names (the schemes in `skinny.cu`, as `launch`, `moe.rs` and the
    /// projections build them) is in exactly one of `skinny.cu`'s modules, the one the host asks
    /// for it: each module compiled by NVRTC for sm_90a (the wide kernels are Hopper's), its
    /// cubin's symbols looked up. Needs NVRTC, not a device; skipped with a notice without it.
    #[test]
    fn every_skinny_kernel_is_in_the_module_the_host_asks() {
        let include = Config::from_env().cuda_include_dir;
        // A module a thread, as the registry compiles them.
        let cubins: Result<Vec<Vec<u8>>, CudaError> = std::thread::scope(|s| {
            let threads: Vec<_> = MODULES
                .iter()
                .map(|m| {
                    let include = include.as_deref();
                    s.spawn(move || compile_module(m, "sm_90a", include))
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("a compile thread"))
                .collect()
        });
        let cubins = match cubins {
            Ok(c) => c,
            Err(CudaError::NoNvrtc) => {
                // The notice through a write that returns its error (the skip must be seen).
                let _ = writeln!(
                    std::io::stderr(),
                    "skipped every_skinny_kernel_is_in_the_module_the_host_asks: no NVRTC here"
                );
                return;
            }
            Err(e) => panic!("compiling skinny.cu's modules: {e}"),
        };
        let index = |m: &ModuleSource| {
            MODULES
                .iter()
                .position(|x| x.name == m.name)
                .expect("one of MODULES")
        };
        let mut checked = 0;
        let mut expect_in = |module: &ModuleSource, name: String| {
            let holders: Vec<&str> = MODULES
                .iter()
                .zip(&cubins)
                .filter(|(_, c)| cubin_has_function(c, &name))
                .map(|(m, _)| m.name)
                .collect();
            assert_eq!(
                holders,
                [module.name],
                "{name}: in {holders:?}, asked of {}",
                module.name
            );
            assert!(cubin_has_function(&cubins[index(module)], &name));
            checked += 1;
        };
        // Every format the tests draw, each kernel name once.
        let mut names = std::collections::HashSet::new();
        for format in QUANT_FORMATS.into_iter().chain(FACTORED_FORMATS) {
            let name = quant_name(&format).unwrap();
            if !names.insert(name) {
                continue;
            }
            let act = format!("{name}_act{}", 12 - format.bits);
            let (skinny, wide) = (expert_module(&format, false), expert_module(&format, true));
            for nt in [1, 2, 4] {
                for ks in [1, 4] {
                    for gate_up in [name, act.as_str()] {
                        expect_in(skinny, format!("moe_skinny_gate_up_{gate_up}_{nt}_{ks}"));
                    }
                    expect_in(skinny, format!("moe_skinny_down_{name}_{nt}_{ks}"));
                }
            }
            for rows in [16, 32, 64] {
                for gate_up in [name, act.as_str()] {
                    expect_in(wide, format!("moe_wide_gate_up_{gate_up}_{rows}"));
                }
                expect_in(wide, format!("moe_wide_down_{name}_{rows}"));
            }
            if format.scale != kestrel_core::quant::ScaleType::Factored {
                for nt in [1, 2, 4] {
                    for ks in [1, 4] {
                        expect_in(&PROJECTIONS, format!("linear_skinny_{name}_{nt}_{ks}"));
                    }
                }
                expect_in(&PROJECTIONS, format!("linear_wide_{name}"));
            }
        }
        for bits in [4, 8] {
            for kernel in ["skinny_permute_x", "wide_permute_x", "wide_permute_bf16"] {
                expect_in(&PROJECTIONS, format!("{kernel}_q{bits}"));
            }
        }
        // Every kernel of the modules was asked for: 36 in each experts' module (three of 12 a
        // format), 18 in each wide one, 24 + 4 + 6 in the projections'.
        assert_eq!(checked, 3 * 36 + 3 * 18 + 34);
    }
}
