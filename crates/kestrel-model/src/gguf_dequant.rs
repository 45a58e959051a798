//! GGUF tensor data as values: the float types as they are, and ggml's block-quantised types
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) either
//! dequantised to f32 with ggml's own formulas, in ggml's order of operations, so every value is
//! the one llama.cpp computes for it ([`dequantize`]), or rewritten exactly as an affine
//! [`QuantMatrix`] with f32 group scales and biases ([`to_affine`]; a k-quant's may be held
//! factored, [`factors`]). Both read each block once through the same decoder: its stored values
//! `q` and, per group, a scale and a bias. Other types are refused with the supported ones named:
//! nothing is re-quantised silently.
//!
//! Every block type is affine per group of 32 (16 for Q2_K, Q3_K and Q6_K): `w = q * scale +
//! bias`, `q` unsigned (Q8_0's signed byte plus 128). For Q4_1, Q5_1, Q2_K, Q4_K and Q5_K that
//! is ggml's own formula (`q * d + m`, `d * q - m`). For the types ggml computes as `(q - z) *
//! d` (Q4_0, Q5_0, Q8_0; Q3_K and Q6_K with `d` their f16 times a signed 6- or 8-bit sub-block
//! scale) the bias is `-z * d`, and every product is exact in f32 (at most an 11-bit f16
//! significand times an 8-bit scale times a 6-bit `q`: 2047 * 128 * 63 < 2^24), as is the sum,
//! whose value `(q - z) * d` f32 holds: the same values, except a zero's sign (ggml's -0 where
//! `d < 0`, the sum's +0). IQ4_NL and IQ4_XS are not affine in their 4-bit codes, which index
//! a table of 16 integers (-127 to 113); stored as that integer plus 128 in 8 bits, they are
//! `(q - 128) * d` with `d` the f16 (IQ4_XS: times a 6-bit sub-block scale less 32), exact the
//! same way (2047 * 32 * 241 < 2^24).

use half::{bf16, f16};
use kestrel_core::quant::{QuantFormat, QuantMatrix, ScaleType};
use rayon::prelude::*;

use crate::gguf::GgmlType;

/// The types [`dequantize`] reads, by ggml name.
pub const SUPPORTED: &[&str] = &[
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS",
];

/// Values of a super-block of the K types.
const QK_K: usize = 256;

/// The block-quantised types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

impl Block {
    fn of(name: &str) -> Option<Block> {
        Some(match name {
            "Q4_0" => Block::Q4_0,
            "Q4_1" => Block::Q4_1,
            "Q5_0" => Block::Q5_0,
            "Q5_1" => Block::Q5_1,
            "Q8_0" => Block::Q8_0,
            "Q2_K" => Block::Q2K,
            "Q3_K" => Block::Q3K,
            "Q4_K" => Block::Q4K,
            "Q5_K" => Block::Q5K,
            "Q6_K" => Block::Q6K,
            "IQ4_NL" => Block::IQ4NL,
            "IQ4_XS" => Block::IQ4XS,
            _ => return None,
        })
    }

    /// Bits a stored value takes in the affine form (5 and 6 bits widen to 8; so do 2 and 3,
    /// whose groups of 16 the 4-bit kernels do not take, and the IQ4 types' table entries).
    fn bits(self) -> u32 {
        match self {
            Block::Q4_0 | Block::Q4_1 | Block::Q4K => 4,
            _ => 8,
        }
    }

    /// Values sharing a scale and a bias.
    fn group(self) -> usize {
        match self {
            Block::Q2K | Block::Q3K | Block::Q6K => 16,
            _ => 32,
        }
    }

    /// For the types ggml computes as `(q - zero) * d`, the zero (the bias is `-zero * d`).
    fn zero(self) -> Option<i32> {
        match self {
            Block::Q4_0 => Some(8),
            Block::Q5_0 => Some(16),
            Block::Q8_0 | Block::IQ4NL | Block::IQ4XS => Some(128),
            Block::Q3K => Some(4),
            Block::Q6K => Some(32),
            _ => None,
        }
    }

    fn format(self) -> QuantFormat {
        QuantFormat::f32_scales(self.bits(), self.group())
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and minimum of sub-block `j` of a Q4_K / Q5_K super-block's 12 scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// IQ4_NL's and IQ4_XS's values of their 4-bit codes (ggml's `kvalues_iq4nl`).
const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// 16 bytes of IQ4 codes as 32 stored values (each code's table entry plus 128): the low
/// nibbles first, then the high ones.
fn iq4_values(qs: &[u8], q: &mut [u8]) {
    let stored = |c: u8| (IQ4_VALUES[c as usize] as i16 + 128) as u8;
    for j in 0..16 {
        q[j] = stored(qs[j] & 0x0F);
        q[j + 16] = stored(qs[j] >> 4);
    }
}

/// One block of `ty` (its `block_bytes` bytes): each value's stored `q` into `q` (the block's
/// values, in order) and each group's `(scale, bias)` into `groups`, the scales computed as ggml
/// computes them.
fn decode(ty: Block, b: &[u8], q: &mut [u8], groups: &mut [(f32, f32)]) {
    match ty {
        Block::Q4_0 | Block::Q4_1 => {
            let d = f16_at(b, 0);
            let (bias, at) = if ty == Block::Q4_1 {
                (f16_at(b, 2), 4)
            } else {
                (-8.0 * d, 2)
            };
            groups[0] = (d, bias);
            for j in 0..16 {
                q[j] = b[at + j] & 0x0F;
                q[j + 16] = b[at + j] >> 4;
            }
        }
        Block::Q5_0 | Block::Q5_1 => {
            let one = ty == Block::Q5_1;
            let d = f16_at(b, 0);
            groups[0] = (d, if one { f16_at(b, 2) } else { -16.0 * d });
            let at = if one { 4 } else { 2 };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            for j in 0..16 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                q[j] = (qs[j] & 0x0F) | h0;
                q[j + 16] = (qs[j] >> 4) | h1;
            }
        }
        Block::Q8_0 => {
            let d = f16_at(b, 0);
            groups[0] = (d, -128.0 * d);
            // The signed byte plus 128.
            for j in 0..32 {
                q[j] = b[2 + j] ^ 0x80;
            }
        }
        Block::Q4K | Block::Q5K => {
            let five = ty == Block::Q5K;
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, mut ql) = if five {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for i in 0..4 {
                let (u1, u2) = (1u8 << (2 * i), 2u8 << (2 * i));
                for k in 0..2 {
                    let (sc, m) = scale_min_k4(2 * i + k, scales);
                    groups[2 * i + k] = (d * sc as f32, -(dmin * m as f32));
                }
                let high = |l: usize, u: u8| if five && qh[l] & u != 0 { 16 } else { 0 };
                let y = 64 * i;
                for l in 0..32 {
                    q[y + l] = (ql[l] & 0x0F) + high(l, u1);
                    q[y + 32 + l] = (ql[l] >> 4) + high(l, u2);
                }
                ql = &ql[32..];
            }
        }
        Block::Q2K => {
            // scales[16] (low nibble the scale, high the minimum), qs[64], d, dmin.
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            for (g, &sc) in groups.iter_mut().zip(&b[0..16]) {
                *g = (d * (sc & 0x0F) as f32, -(dmin * (sc >> 4) as f32));
            }
            // Each 32 bytes of qs hold 128 values, 2 bits at a time: the lowest bits of all 32
            // bytes first.
            for (half, qs) in b[16..80].chunks_exact(32).enumerate() {
                for shift in 0..4 {
                    let y = &mut q[half * 128 + shift * 32..][..32];
                    for (y, &v) in y.iter_mut().zip(qs) {
                        *y = (v >> (2 * shift)) & 3;
                    }
                }
            }
        }
        Block::Q3K => {
            // hmask[32], qs[64], scales[12] (16 six-bit scales, less 32), d.
            let d = f16_at(b, 108);
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            for (i, g) in groups.iter_mut().enumerate() {
                let low = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
                let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
                let s = d * ((low | high << 4) as i32 - 32) as f32;
                *g = (s, -4.0 * s);
            }
            // As Q2_K's low bits; the high bit of value i * 32 + l is bit i of hmask[l], and a
            // set bit adds 4.
            for (half, qs) in qs.chunks_exact(32).enumerate() {
                for shift in 0..4 {
                    let at = half * 128 + shift * 32;
                    let bit = (half * 4 + shift) as u32;
                    for (l, &v) in qs.iter().enumerate() {
                        q[at + l] = ((v >> (2 * shift)) & 3) | ((hmask[l] >> bit) & 1) << 2;
                    }
                }
            }
        }
        Block::IQ4NL => {
            let d = f16_at(b, 0);
            groups[0] = (d, -128.0 * d);
            iq4_values(&b[2..18], q);
        }
        Block::IQ4XS => {
            // d, scales_h (u16), scales_l[4], qs[128].
            let d = f16_at(b, 0);
            let high = u16::from_le_bytes([b[2], b[3]]);
            for (i, g) in groups.iter_mut().enumerate() {
                let low = (b[4 + i / 2] >> (4 * (i % 2))) & 0x0F;
                let ls = low as i32 | (((high >> (2 * i)) & 3) as i32) << 4;
                let s = d * (ls - 32) as f32;
                *g = (s, -128.0 * s);
            }
            for (i, qs) in b[8..136].chunks_exact(16).enumerate() {
                iq4_values(qs, &mut q[32 * i..32 * i + 32]);
            }
        }
        Block::Q6K => {
            let d = f16_at(b, 208);
            for (g, &sc) in groups.iter_mut().zip(&b[192..208]) {
                let s = d * sc as i8 as f32;
                *g = (s, -32.0 * s);
            }
            let (mut ql, mut qh) = (&b[0..128], &b[128..192]);
            for half in 0..2 {
                let y = &mut q[half * 128..];
                for l in 0..32 {
                    y[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                    y[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                    y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
                ql = &ql[64..];
                qh = &qh[32..];
            }
        }
    }
}

/// Each block of `ty` in `bytes` (blocks of `n` values in `per` bytes) decoded once, and handed
/// with its bytes and its item of `outs` (one a block) to `f`, in parallel.
fn each_block<O: Send>(
    ty: Block,
    (n, per): (usize, usize),
    bytes: &[u8],
    outs: impl IndexedParallelIterator<Item = O>,
    f: impl Fn(&[u8], &[u8], &[(f32, f32)], O) + Sync + Send,
) {
    let groups = n / ty.group();
    outs.zip(bytes.par_chunks_exact(per)).for_each(|(o, b)| {
        let (mut q, mut g) = ([0u8; QK_K], [(0f32, 0f32); QK_K / 16]);
        decode(ty, b, &mut q[..n], &mut g[..groups]);
        f(b, &q[..n], &g[..groups], o);
    });
}

/// `len` zeroed items, or an error saying how much memory `what` needed. The threads write the
/// zeros (and so take the new pages' faults) a share each: a model's load allocates gigabytes.
fn zeros<T: Clone + Default + Send + Sync>(len: usize, what: &str) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        format!(
            "{} MiB for {what} could not be allocated",
            len.saturating_mul(std::mem::size_of::<T>()) >> 20
        )
    })?;
    v.par_extend(rayon::iter::repeat_n(T::default(), len));
    Ok(v)
}

/// Whether `ty` is one [`dequantize`] reads.
pub fn supported(ty: GgmlType) -> bool {
    SUPPORTED.contains(&ty.name)
}

/// The values of `bytes`, data of type `ty` (whole blocks; the reader checked the length), as
/// f32. An error names the type and the supported ones when `ty` is not read.
pub fn dequantize(ty: GgmlType, bytes: &[u8]) -> Result<Vec<f32>, String> {
    if !supported(ty) {
        return Err(format!(
            "its type {} is not read (supported: {})",
            ty.name,
            SUPPORTED.join(", ")
        ));
    }
    let (n, per) = (ty.block as usize, ty.block_bytes as usize);
    debug_assert_eq!(bytes.len() % per, 0);
    let mut out = zeros::<f32>(bytes.len() / per * n, "its values as f32")?;
    match ty.name {
        "F32" => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        "F16" => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        "BF16" => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        name => {
            let ty = Block::of(name).expect("a supported type that is not a float is a block type");
            debug_assert!(n == 32 || n == QK_K);
            let (group, zero) = (ty.group(), ty.zero());
            each_block(ty, (n, per), bytes, out.par_chunks_mut(n), |_, q, groups, o| {
                for (i, (o, &q)) in o.iter_mut().zip(q).enumerate() {
                    let (scale, bias) = groups[i / group];
                    // ggml's formula for the type: (q - zero) * d, or q * d + m (`d * q - m`
                    // for the K types, the same bits).
                    *o = match zero {
                        Some(z) => (q as i32 - z) as f32 * scale,
                        None => q as f32 * scale + bias,
                    };
                }
            });
        }
    }
    Ok(out)
}

/// The affine format [`to_affine`] gives a tensor of type `ty`: 4 bits (Q4_0, Q4_1, Q4_K) or 8
/// (the others), groups of 32 (16 for Q2_K, Q3_K and Q6_K), f32 scales and biases. None for
/// the float types and those not read.
pub fn affine_format(ty: GgmlType) -> Option<QuantFormat> {
    Block::of(ty.name).map(Block::format)
}

/// Whether `ty` is a k-quant whose group scales and biases [`to_affine`] gives are each one f32
/// unit a super-block of 256 values times a signed byte ([`ScaleType::Factored`] holds them so):
/// an f16 times a sub-block's 4-, 6- or 8-bit scale (minimum), or times such a scale and a fixed
/// integer (Q3_K's and Q6_K's biases, `-4 d sc` and `-32 d sc`; IQ4_XS's `-128 d sc`).
pub fn factors(ty: GgmlType) -> bool {
    matches!(
        Block::of(ty.name),
        Some(Block::Q2K | Block::Q3K | Block::Q4K | Block::Q5K | Block::Q6K | Block::IQ4XS)
    )
}

/// `bytes`, a `[rows, cols]` matrix of type `ty` (rows of whole blocks), as an affine matrix in
/// [`affine_format`]`(ty)`, holding every value ggml computes exactly (see the module's header).
/// An error when `ty` is not a block type or the bytes are not such a matrix.
pub fn to_affine(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<QuantMatrix, String> {
    let Some(block) = Block::of(ty.name) else {
        return Err(format!(
            "its type {} is not a block-quantised type Kestrel reads (those are: {})",
            ty.name,
            SUPPORTED[3..].join(", ")
        ));
    };
    let (n, per) = (ty.block as usize, ty.block_bytes as usize);
    let blocks = block_count(ty, bytes, rows, cols)?;
    let format = block.format();
    let (words, groups) = (n / format.values_per_word(), n / format.group_size);
    let mut weight = zeros::<u32>(blocks * words, "its values")?;
    let mut scales = zeros::<f32>(blocks * groups, "its scales")?;
    let mut biases = zeros::<f32>(blocks * groups, "its biases")?;
    let bits = format.bits;
    let outs = weight
        .par_chunks_mut(words)
        .zip(scales.par_chunks_mut(groups))
        .zip(biases.par_chunks_mut(groups));
    each_block(block, (n, per), bytes, outs, |_, q, g, ((w, s), b)| {
        pack_words(q, bits, w);
        for ((s, b), &(scale, bias)) in s.iter_mut().zip(b.iter_mut()).zip(g) {
            (*s, *b) = (scale, bias);
        }
    });
    Ok(QuantMatrix {
        format,
        rows,
        cols,
        weight,
        scales,
        biases,
    })
}

/// The blocks of `bytes`, a `[rows, cols]` matrix of `ty` (rows of whole blocks), or an error
/// saying why they are not one.
fn block_count(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<usize, String> {
    let (n, per) = (ty.block as usize, ty.block_bytes as usize);
    if cols == 0 || cols % n != 0 {
        return Err(format!(
            "rows of {cols} values are not whole {} blocks of {n}",
            ty.name
        ));
    }
    rows.checked_mul(cols / n)
        .filter(|b| b.checked_mul(per) == Some(bytes.len()))
        .ok_or_else(|| {
            format!(
                "{} bytes are not {rows} rows of {cols} {} values",
                bytes.len(),
                ty.name
            )
        })
}

/// A quantised matrix as it is held: its packed values and the two parts
/// [`QuantFormat::group_bytes`] writes for its groups' scales and biases (factored ones from
/// [`to_factored`]).
#[derive(Debug)]
pub struct QuantParts {
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub weight: Vec<u32>,
    pub scale_part: Vec<u8>,
    pub bias_part: Vec<u8>,
}

/// `bytes` as [`to_affine`] holds them, factored straight from the blocks for the k-quants whose
/// super-block scales are one f16 times sub-block integers: Q4_K and Q5_K (the units `d` and
/// `-dmin`, each group's pair its 6-bit scale and minimum) and Q6_K (`d` and `-32 d`, the pair
/// its signed 8-bit scale twice). Every group's scale and bias is then the value `to_affine`
/// computes, bit for bit, and no super-block needs [`QuantFormat::group_bytes`]'s search for
/// its unit (a quarter of a Q4_K_M file's load). None for other types; an error as for
/// `to_affine`, or when a super-block's f16 is not finite.
pub fn to_factored(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Option<Result<QuantParts, String>> {
    let block = Block::of(ty.name).filter(|b| matches!(b, Block::Q4K | Block::Q5K | Block::Q6K))?;
    Some(factored_blocks(block, ty, bytes, rows, cols))
}

/// [`to_factored`] for one of the block types it takes: each block (a super-block of 256) gives
/// its values, its groups' pairs and its two units.
fn factored_blocks(
    block: Block,
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Result<QuantParts, String> {
    let (n, per) = (ty.block as usize, ty.block_bytes as usize);
    let blocks = block_count(ty, bytes, rows, cols)?;
    let format = QuantFormat::factored(block.bits(), block.group());
    let (words, groups) = (n / format.values_per_word(), n / format.group_size);
    let mut weight = zeros::<u32>(blocks * words, "its values")?;
    let mut scale_part = zeros::<u8>(blocks * 2 * groups, "its scales")?;
    let mut bias_part = zeros::<u8>(blocks * 8, "its units")?;
    let bits = format.bits;
    let finite = std::sync::atomic::AtomicBool::new(true);
    let outs = weight
        .par_chunks_mut(words)
        .zip(scale_part.par_chunks_mut(2 * groups))
        .zip(bias_part.par_chunks_mut(8));
    each_block(block, (n, per), bytes, outs, |b, q, _, ((w, pairs), units)| {
        pack_words(q, bits, w);
        let (unit_scale, unit_bias) = match block {
            Block::Q6K => {
                for (p, &sc) in pairs.chunks_exact_mut(2).zip(&b[192..208]) {
                    p.copy_from_slice(&[sc, sc]);
                }
                let d = f16_at(b, 208);
                (d, -32.0 * d)
            }
            _ => {
                for (j, p) in pairs.chunks_exact_mut(2).enumerate() {
                    let (sc, m) = scale_min_k4(j, &b[4..16]);
                    p.copy_from_slice(&[sc, m]);
                }
                (f16_at(b, 0), -f16_at(b, 2))
            }
        };
        if !(unit_scale.is_finite() && unit_bias.is_finite()) {
            finite.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        units[..4].copy_from_slice(&unit_scale.to_le_bytes());
        units[4..].copy_from_slice(&unit_bias.to_le_bytes());
    });
    if !finite.into_inner() {
        return Err(format!("a {} super-block's scale is not finite", ty.name));
    }
    Ok(QuantParts {
        format,
        rows,
        cols,
        weight,
        scale_part,
        bias_part,
    })
}

/// Stored values `q` (each below `1 << bits`; 4 or 8 bits) packed into `words`, lowest bits
/// first, as [`QuantMatrix`] holds them: 8 values a word at 4 bits (a word's 8 bytes folded
/// together in three shifts), 4 at 8 bits (the bytes as they are).
fn pack_words(q: &[u8], bits: u32, words: &mut [u32]) {
    match bits {
        4 => {
            for (w, q) in words.iter_mut().zip(q.chunks_exact(8)) {
                let x = u64::from_le_bytes(q.try_into().expect("8 values"));
                let x = (x | x >> 4) & 0x00FF_00FF_00FF_00FF;
                let x = (x | x >> 8) & 0x0000_FFFF_0000_FFFF;
                *w = (x | x >> 16) as u32;
            }
        }
        8 => {
            for (w, q) in words.iter_mut().zip(q.chunks_exact(4)) {
                *w = u32::from_le_bytes(q.try_into().expect("4 values"));
            }
        }
        _ => unreachable!("affine blocks are held in 4 or 8 bits"),
    }
}

/// The narrowest format holding each of `formats` exactly through [`widen`]: the most bits, the
/// smallest group, and the first one's scale type where all share it, else f32 (which holds a
/// factored scale's value). None for none.
pub fn common_format(formats: &[QuantFormat]) -> Option<QuantFormat> {
    let first = *formats.first()?;
    let same = formats.iter().all(|f| f.scale == first.scale);
    Some(QuantFormat {
        bits: formats.iter().map(|f| f.bits).max()?,
        group_size: formats.iter().map(|f| f.group_size).min()?,
        scale: if same { first.scale } else { ScaleType::F32 },
    })
}

/// `m` stored in the format `to`, every value exactly the same: `to` has as many bits or more
/// (a 4-bit value is the same number in 8 bits) and groups that divide `m`'s (the parts of a
/// group keep its scale and bias). An error when `to` cannot hold `m` so.
pub fn widen(m: QuantMatrix, to: QuantFormat) -> Result<QuantMatrix, String> {
    let from = m.format;
    if from == to {
        return Ok(m);
    }
    // A group's values are kept as they are: f32 holds any scale type's.
    if (to.scale != from.scale && to.scale != ScaleType::F32)
        || to.bits < from.bits
        || m.cols == 0
        || !to.fits(m.cols)
        || from.group_size % to.group_size != 0
    {
        return Err(format!("{from:?} cannot be held exactly as {to:?}"));
    }
    let cols = m.cols;
    let weight = if to.bits == from.bits {
        m.weight
    } else {
        let (wf, wt) = (from.words_per_row(cols), to.words_per_row(cols));
        let mut out = zeros::<u32>(m.rows * wt, "its widened values")?;
        let (vf, vt, mask) = (
            from.values_per_word(),
            to.values_per_word(),
            (1u32 << from.bits) - 1,
        );
        let (bf, bt) = (from.bits as usize, to.bits as usize);
        out.par_chunks_mut(wt)
            .zip(m.weight.par_chunks(wf))
            .for_each(|(o, w)| {
                for c in 0..cols {
                    let q = (w[c / vf] >> (bf * (c % vf))) & mask;
                    o[c / vt] |= q << (bt * (c % vt));
                }
            });
        out
    };
    let split = from.group_size / to.group_size;
    let repeat = |v: Vec<f32>| -> Result<Vec<f32>, String> {
        if split == 1 {
            return Ok(v);
        }
        let mut out = zeros::<f32>(v.len() * split, "its widened scales")?;
        for (o, x) in out.chunks_exact_mut(split).zip(v) {
            o.fill(x);
        }
        Ok(out)
    };
    Ok(QuantMatrix {
        format: to,
        rows: m.rows,
        cols,
        weight,
        scales: repeat(m.scales)?,
        biases: repeat(m.biases)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty(name: &str) -> GgmlType {
        (0..40)
            .filter_map(GgmlType::from_id)
            .find(|t| t.name == name)
            .unwrap()
    }

    #[test]
    fn q8_0_and_q4_0_blocks_follow_their_formulas() {
        // d = 0.5: Q8_0 values are q / 2; Q4_0 values (nibble - 8) / 2.
        let mut q8 = f16::from_f32(0.5).to_le_bytes().to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = dequantize(ty("Q8_0"), &q8).unwrap();
        assert_eq!(v, (0..32).map(|i| (i - 16) as f32 * 0.5).collect::<Vec<_>>());
        let mut q4 = f16::from_f32(0.5).to_le_bytes().to_vec();
        q4.extend((0..16).map(|i| (i as u8) | ((15 - i as u8) << 4)));
        let v = dequantize(ty("Q4_0"), &q4).unwrap();
        for j in 0..16 {
            assert_eq!(v[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(v[j + 16], (7.0 - j as f32) * 0.5);
        }
    }

    #[test]
    fn unsupported_types_are_named() {
        let e = dequantize(ty("IQ2_XXS"), &[0; 66]).unwrap_err();
        assert!(e.contains("IQ2_XXS") && e.contains("Q6_K"), "{e}");
        let e = to_affine(ty("IQ2_XXS"), &[0; 66], 1, 256).unwrap_err();
        assert!(e.contains("IQ2_XXS") && e.contains("Q6_K"), "{e}");
        let e = to_affine(ty("F16"), &[0; 64], 1, 32).unwrap_err();
        assert!(e.contains("F16"), "{e}");
    }

    #[test]
    fn affine_blocks_store_q_and_the_bias() {
        // Q8_0, d = 0.5: the signed byte plus 128, bias -64; packed four to a word, lowest first.
        let mut q8 = f16::from_f32(0.5).to_le_bytes().to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let m = to_affine(ty("Q8_0"), &q8, 1, 32).unwrap();
        assert_eq!(m.format, QuantFormat::f32_scales(8, 32));
        assert_eq!(
            (m.scales.as_slice(), m.biases.as_slice()),
            (&[0.5f32][..], &[-64.0f32][..])
        );
        assert_eq!(m.weight[0], u32::from_le_bytes([112, 113, 114, 115]));
        assert_eq!(m.dequantize(), dequantize(ty("Q8_0"), &q8).unwrap());
        // Rows that are not whole blocks, and bytes that are not the matrix, are errors.
        assert!(to_affine(ty("Q8_0"), &q8, 1, 16).unwrap_err().contains("whole"));
        assert!(to_affine(ty("Q8_0"), &q8, 2, 32)
            .unwrap_err()
            .contains("34 bytes"));
    }

    /// The shifts pack as the plain fold does, for every value in every place.
    #[test]
    fn words_pack_lowest_bits_first() {
        let mut rng = kestrel_core::rng::Rng::new(7);
        for bits in [4u32, 8] {
            let q: Vec<u8> = (0..4096).map(|_| rng.range(0, 1 << bits) as u8).collect();
            let per = 32 / bits as usize;
            let mut words = vec![0u32; q.len() / per];
            pack_words(&q, bits, &mut words);
            let want: Vec<u32> = q
                .chunks_exact(per)
                .map(|c| {
                    c.iter()
                        .enumerate()
                        .fold(0, |a, (i, &v)| a | (v as u32) << (bits as usize * i))
                })
                .collect();
            assert_eq!(words, want, "{bits} bits");
        }
    }

    /// Q4_K, Q5_K and Q6_K blocks of random bytes (their f16s finite, of either sign, some zero)
    /// factored straight from the blocks: the same packed values as `to_affine`'s and every
    /// group's scale and bias its value bit for bit; a non-finite f16 is an error, and other
    /// types are left to `group_bytes`.
    #[test]
    fn factored_blocks_give_the_affine_values() {
        let mut rng = kestrel_core::rng::Rng::new(11);
        for name in ["Q4_K", "Q5_K", "Q6_K"] {
            let t = ty(name);
            let (rows, cols) = (3, 512);
            let per = t.block_bytes as usize;
            let mut bytes: Vec<u8> = (0..rows * cols / 256 * per)
                .map(|_| rng.range(0, 256) as u8)
                .collect();
            // Where each block's f16s lie: d and dmin first (Q4_K, Q5_K), d last (Q6_K).
            let at: &[usize] = if name == "Q6_K" { &[208] } else { &[0, 2] };
            for (k, b) in bytes.chunks_exact_mut(per).enumerate() {
                for &o in at {
                    let v = match (k + o) % 5 {
                        0 => 0.0,
                        _ => (rng.range(1, 2000) as f32 - 1000.0) * 1.0e-4,
                    };
                    b[o..o + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            let m = to_affine(t, &bytes, rows, cols).unwrap();
            let f = to_factored(t, &bytes, rows, cols).unwrap().unwrap();
            assert_eq!(f.format.scale, ScaleType::Factored, "{name}");
            assert_eq!(
                (f.format.bits, f.format.group_size),
                (m.format.bits, m.format.group_size)
            );
            assert_eq!(f.weight, m.weight, "{name}");
            let (s, b) = f.format.group_values(&f.scale_part, &f.bias_part);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&s), bits(&m.scales), "{name} scales");
            assert_eq!(bits(&b), bits(&m.biases), "{name} biases");
            // An infinite d in the second block.
            let o = per + at[0];
            bytes[o..o + 2].copy_from_slice(&f16::INFINITY.to_le_bytes());
            let e = to_factored(t, &bytes, rows, cols).unwrap().unwrap_err();
            assert!(e.contains("not finite") && e.contains(name), "{e}");
            assert!(to_factored(t, &bytes, rows, 256).unwrap().is_err());
        }
        assert!(to_factored(ty("Q4_0"), &[0; 18], 1, 32).is_none());
        assert!(to_factored(ty("Q2_K"), &[0; 84], 1, 256).is_none());
    }

    #[test]
    fn widening_keeps_every_value() {
        // Two rows of two Q4_0 blocks as 8 bits in groups of 16: the same values.
        let mut b = Vec::new();
        for (k, d) in [0.5f32, -0.25, 2.0, 0.125].into_iter().enumerate() {
            b.extend(f16::from_f32(d).to_le_bytes());
            b.extend((0..16).map(|i| ((i + k) % 16) as u8 | (((7 * i + k) % 16) as u8) << 4));
        }
        let m = to_affine(ty("Q4_0"), &b, 2, 64).unwrap();
        let to = common_format(&[m.format, QuantFormat::f32_scales(8, 16)]).unwrap();
        assert_eq!(to, QuantFormat::f32_scales(8, 16));
        let w = widen(m.clone(), to).unwrap();
        assert_eq!(w.format, to);
        assert_eq!(w.dequantize(), m.dequantize());
        assert!(widen(w, QuantFormat::f32_scales(4, 32)).is_err());
    }
}
