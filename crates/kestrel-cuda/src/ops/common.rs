//! What every op family's encoder shares: the headers its kernels include, the description of
//! a family's module, staged-vector sizes, kernel-name suffixes, the alignment the tensor-core
//! products' loads need of a quantised weight, argument conversion, the error an unsupported
//! shape gives, and the K split of the tensor-core products.

use kestrel_core::quant::{QuantFormat, ScaleType};
use kestrel_core::DType;
use kestrel_cuda_rt::{Buffer, CudaError, DispatchBuilder, ModuleSource, Result, PDL_HEADER};

use crate::encoder::Encoder;

/// Headers every op module may include, handed to NVRTC in memory.
const HEADERS: &[(&str, &str)] = &[
    PDL_HEADER,
    ("kestrel.cuh", include_str!("../../kernels/kestrel.cuh")),
    ("slots.cuh", include_str!("../../kernels/slots.cuh")),
];

/// The module `kernels/<name>.cu` (its `source`), with the shared headers and `defines`.
pub(crate) const fn op_module(
    name: &'static str,
    source: &'static str,
    defines: &'static [(&'static str, i64)],
) -> ModuleSource {
    ModuleSource {
        name,
        source,
        headers: HEADERS,
        defines,
    }
}

/// Floats of shared memory for `n` staged values (`padded_len` in kestrel.cuh).
pub(crate) fn padded_len(n: usize) -> usize {
    n + n.div_ceil(32) * 4
}

/// The kernel-name suffix of a float dtype.
pub(crate) fn float_name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(dtype.name()),
        other => Err(unsupported(format!("{other} is not a float dtype"))),
    }
}

/// A quantised format's kernel-name part: `q4`, `q8` with bf16 group scales and biases, `q4f`,
/// `q8f` with f32 ones, `q4k`, `q8k` with factored ones (which only the expert kernels take).
pub(crate) fn quant_name(format: &QuantFormat) -> Result<&'static str> {
    match (format.bits, format.scale) {
        (4, ScaleType::Bf16) => Ok("q4"),
        (8, ScaleType::Bf16) => Ok("q8"),
        (4, ScaleType::F32) => Ok("q4f"),
        (8, ScaleType::F32) => Ok("q8f"),
        (4, ScaleType::Factored) => Ok("q4k"),
        (8, ScaleType::Factored) => Ok("q8k"),
        (b, _) => Err(unsupported(format!("{b}-bit weights"))),
    }
}

/// Whether a quantised weight's parts (words, scales, biases, as `linear::weight_parts` gives
/// them) are aligned for the tensor-core kernels' loads: 16-byte loads of the words, the scales
/// and biases in their own type.
pub(crate) fn quant_parts_aligned(format: &QuantFormat, parts: &[Buffer]) -> bool {
    let size = format.scale.size_in_bytes() as u64;
    parts[0].device_ptr() % 16 == 0 && parts[1].device_ptr() % size == 0 && parts[2].device_ptr() % size == 0
}

pub(crate) fn unsupported(reason: String) -> CudaError {
    CudaError::Op {
        node: String::new(),
        reason,
    }
}

pub(crate) fn u32_arg(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| unsupported(format!("{n} does not fit a 32-bit kernel argument")))
}

/// Ranges of K a product of `tiles` output tiles splits into: equal ranges of whole steps
/// (`steps` in all), doubled while `2 * tiles * splits` stays within `blocks`, up to `max`
/// ranges of at least `min_steps` steps each.
pub(crate) fn k_splits(tiles: usize, steps: usize, blocks: usize, max: usize, min_steps: usize) -> usize {
    let mut splits = 1;
    while splits < max
        && 2 * tiles * splits <= blocks
        && steps % (2 * splits) == 0
        && steps / (2 * splits) >= min_steps
    {
        splits *= 2;
    }
    splits
}

/// The partial tiles (`splits * tiles * tile_values` f32) and a counter a tile for a product split
/// over K, or None for one split.
pub(crate) fn split_scratch(
    enc: &mut Encoder,
    splits: usize,
    tiles: usize,
    tile_values: usize,
) -> Result<Option<(Buffer, Buffer)>> {
    Ok(match splits {
        1 => None,
        _ => Some((
            enc.workspace(DType::F32, splits * tiles * tile_values)?,
            enc.counters(tiles)?,
        )),
    })
}

/// The partial tiles' and counters' arguments of a K-split product, or null pointers for one
/// split, so the dispatch declares no access to the counters other kernels take turns on.
pub(crate) fn split_args<'a>(
    b: DispatchBuilder<'a>,
    scratch: &Option<(Buffer, Buffer)>,
) -> DispatchBuilder<'a> {
    match scratch {
        Some((part, counters)) => b.write(part).read_write(counters),
        None => b.arg(0u64).arg(0u64),
    }
}

#[cfg(test)]
mod tests {
    use super::k_splits;

    /// The splits the H200's runs took (132 multiprocessors): the wide projections of a 64-token
    /// step of Qwen3-30B-A3B (up to three blocks a multiprocessor, at least two stages of 128
    /// values a range), and the GEMM tiles of a 256- and a 512-token prefill (one block each).
    #[test]
    fn k_splits_double_while_the_blocks_fit_and_the_ranges_are_long_enough() {
        // qkv (80 tiles of 64 outputs, 16 stages), o_proj (32 tiles, 32 stages), lm_head.
        assert_eq!(k_splits(80, 16, 3 * 132, 8, 2), 4);
        assert_eq!(k_splits(32, 32, 3 * 132, 8, 2), 8);
        assert_eq!(k_splits(2374, 16, 3 * 132, 8, 2), 1);
        // Two stages a range at least: 8 stages split no more than four ways.
        assert_eq!(k_splits(1, 8, 3 * 132, 8, 2), 4);
        // K that does not halve evenly is not split.
        assert_eq!(k_splits(1, 15, 3 * 132, 8, 2), 1);
        // The o_proj of 256 tokens (2 x 16 tiles of 128 x 128, 64 steps of 64): 4 ranges; of 512
        // tokens (64 tiles): 2; of 1,024 (128 tiles): none; 16 tiles: 8, the most.
        assert_eq!(k_splits(32, 64, 132, 8, 4), 4);
        assert_eq!(k_splits(64, 64, 132, 8, 4), 2);
        assert_eq!(k_splits(128, 64, 132, 8, 4), 1);
        assert_eq!(k_splits(16, 64, 132, 8, 4), 8);
    }
}
