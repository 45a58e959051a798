//! What every op family's encoder shares: the headers its kernels include, the description of
//! a family's module, staged-vector sizes, kernel-name suffixes, argument conversion and the
//! error an unsupported shape gives.

use kestrel_core::quant::{QuantFormat, ScaleType};
use kestrel_core::DType;
use kestrel_cuda_rt::{CudaError, ModuleSource, Result, PDL_HEADER};

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

pub(crate) fn unsupported(reason: String) -> CudaError {
    CudaError::Op {
        node: String::new(),
        reason,
    }
}

pub(crate) fn u32_arg(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| unsupported(format!("{n} does not fit a 32-bit kernel argument")))
}
