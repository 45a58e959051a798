//! Affine quantisation in the MLX layout, on the host.
//!
//! A row of `cols` weights is cut into groups of `group_size`; each group has a `scale` and a
//! `bias`, and each weight is stored as `q` in `bits` bits with `w = q * scale + bias`.
//! Values are packed into little-endian `u32` words, lowest bits first: with 4 bits a word holds
//! 8 values, with 8 bits 4. A `[rows, cols]` matrix becomes `weight: u32 [rows, cols * bits / 32]`,
//! `scales` and `biases: [rows, cols / group_size]`, in bf16 as MLX stores them, or in f32 for
//! what bf16 cannot hold exactly (GGUF's block formats: a k-quant's scale is an f16 times a 6-bit
//! integer), or factored as a k-quant stores them ([`ScaleType::Factored`]): per group a signed
//! byte of the scale and one of the bias, per 256 values an f32 unit each is a multiple of.

use half::bf16;

/// How a quantised matrix stores its group scales and biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleType {
    Bf16,
    F32,
    /// A k-quant's two levels, exactly: each group's scale is `units[s].0 * n_scale` and its bias
    /// `units[s].1 * n_bias`, `n_scale` and `n_bias` signed bytes of the group and `units[s]` two
    /// f32 of its super-block of [`SUPER_BLOCK`] values. The `scales` part holds the bytes,
    /// `[n_scale, n_bias]` a group; the `biases` part the units, `[unit_scale, unit_bias]` (f32) a
    /// super-block. Rows are whole super-blocks.
    Factored,
}

/// Values sharing the units of [`ScaleType::Factored`] (a k-quant's super-block).
pub const SUPER_BLOCK: usize = 256;

impl ScaleType {
    /// Bytes of one stored scale (or bias) of the plain types; for `Factored`, of a group's pair
    /// of multiples (the units are counted apart: [`QuantFormat::bias_part`]).
    pub fn size_in_bytes(&self) -> usize {
        match self {
            ScaleType::Bf16 | ScaleType::Factored => 2,
            ScaleType::F32 => 4,
        }
    }

    /// `v` as this type stores it.
    pub fn round(&self, v: f32) -> f32 {
        match self {
            ScaleType::Bf16 => bf16::from_f32(v).to_f32(),
            ScaleType::F32 | ScaleType::Factored => v,
        }
    }

    /// The little-endian bytes of `values` in this type (each already representable) into `out`
    /// (as many values' bytes): a plain type's, or as f32 (`Factored`'s units; its multiples are
    /// written by [`QuantFormat::group_bytes`]).
    fn write(&self, values: &[f32], out: &mut [u8]) {
        match self {
            ScaleType::Bf16 => {
                for (o, &v) in out.chunks_exact_mut(2).zip(values) {
                    o.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
            }
            ScaleType::F32 | ScaleType::Factored => {
                for (o, &v) in out.chunks_exact_mut(4).zip(values) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }

    /// Values from little-endian bytes of a plain type (`Factored`: f32, its units).
    fn values(&self, bytes: &[u8]) -> Vec<f32> {
        match self {
            ScaleType::Bf16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            ScaleType::F32 | ScaleType::Factored => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        }
    }
}

/// Shape and encoding of one quantised matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantFormat {
    pub bits: u32,
    pub group_size: usize,
    pub scale: ScaleType,
}

impl QuantFormat {
    pub const Q4: QuantFormat = QuantFormat::mlx(4, 64);
    pub const Q8: QuantFormat = QuantFormat::mlx(8, 64);

    /// MLX's format: bf16 scales and biases.
    pub const fn mlx(bits: u32, group_size: usize) -> QuantFormat {
        QuantFormat {
            bits,
            group_size,
            scale: ScaleType::Bf16,
        }
    }

    /// The same values with f32 scales and biases.
    pub const fn f32_scales(bits: u32, group_size: usize) -> QuantFormat {
        QuantFormat {
            bits,
            group_size,
            scale: ScaleType::F32,
        }
    }

    /// The same values factored as a k-quant stores them ([`ScaleType::Factored`]).
    pub const fn factored(bits: u32, group_size: usize) -> QuantFormat {
        QuantFormat {
            bits,
            group_size,
            scale: ScaleType::Factored,
        }
    }

    /// Groups sharing the units of a super-block (`Factored`).
    pub fn groups_per_super(&self) -> usize {
        SUPER_BLOCK / self.group_size
    }

    pub fn values_per_word(&self) -> usize {
        (32 / self.bits) as usize
    }

    /// `u32` words per row of `cols` values.
    pub fn words_per_row(&self, cols: usize) -> usize {
        cols / self.values_per_word()
    }

    pub fn groups_per_row(&self, cols: usize) -> usize {
        cols / self.group_size
    }

    /// Whether a row of `cols` can be stored in this format.
    pub fn fits(&self, cols: usize) -> bool {
        matches!(self.bits, 4 | 8)
            && self.group_size > 0
            && cols % self.group_size == 0
            && self.group_size % self.values_per_word() == 0
            && (self.scale != ScaleType::Factored
                || (SUPER_BLOCK % self.group_size == 0 && cols % SUPER_BLOCK == 0))
    }

    /// Bytes of the `scales` part of a `[rows, cols]` matrix.
    pub fn scale_part(&self, rows: usize, cols: usize) -> usize {
        rows * self.groups_per_row(cols) * self.scale.size_in_bytes()
    }

    /// Bytes of the `biases` part of a `[rows, cols]` matrix (`Factored`: the units).
    pub fn bias_part(&self, rows: usize, cols: usize) -> usize {
        match self.scale {
            ScaleType::Factored => rows * (cols / SUPER_BLOCK) * 8,
            _ => self.scale_part(rows, cols),
        }
    }

    /// Bytes of weight, scales and biases for a `[rows, cols]` matrix.
    pub fn bytes(&self, rows: usize, cols: usize) -> usize {
        rows * self.words_per_row(cols) * 4 + self.scale_part(rows, cols) + self.bias_part(rows, cols)
    }

    /// The `scales` and `biases` parts storing the groups' `scales` and `biases` (row-major, whole
    /// rows). None when this format cannot hold them exactly: a plain type's values must be
    /// representable in it ([`ScaleType::round`]); a factored super-block's scales (and its
    /// biases) must be one unit's multiples by signed bytes, as every k-quant's are.
    pub fn group_bytes(&self, scales: &[f32], biases: &[f32]) -> Option<(Vec<u8>, Vec<u8>)> {
        let (s, b) = self.group_parts_len(scales.len())?;
        let (mut sp, mut bp) = (vec![0u8; s], vec![0u8; b]);
        self.group_bytes_into(scales, biases, &mut sp, &mut bp)
            .then_some((sp, bp))
    }

    /// The lengths of the `scales` and `biases` parts of `groups` groups (whole super-blocks
    /// for a factored format), or None.
    pub fn group_parts_len(&self, groups: usize) -> Option<(usize, usize)> {
        match self.scale {
            ScaleType::Factored => {
                let per = self.groups_per_super();
                (per > 0 && groups % per == 0).then(|| (2 * groups, 8 * (groups / per)))
            }
            plain => Some((plain.size_in_bytes() * groups, plain.size_in_bytes() * groups)),
        }
    }

    /// [`QuantFormat::group_bytes`] written into `scale_part` and `bias_part`, of the lengths
    /// [`QuantFormat::group_parts_len`] gives: false (the parts' contents unspecified) where it
    /// gives None. Parts of consecutive whole super-blocks (rows) are consecutive pieces of the
    /// whole's, so a caller may fill them piece by piece, in parallel.
    pub fn group_bytes_into(
        &self,
        scales: &[f32],
        biases: &[f32],
        scale_part: &mut [u8],
        bias_part: &mut [u8],
    ) -> bool {
        if scales.len() != biases.len()
            || self.group_parts_len(scales.len()) != Some((scale_part.len(), bias_part.len()))
        {
            return false;
        }
        if self.scale != ScaleType::Factored {
            let exact = |v: &[f32]| v.iter().all(|&x| self.scale.round(x).to_bits() == x.to_bits());
            if !(exact(scales) && exact(biases)) {
                return false;
            }
            self.scale.write(scales, scale_part);
            self.scale.write(biases, bias_part);
            return true;
        }
        let per = self.groups_per_super();
        if per > MAX_FACTORED_GROUPS {
            return false;
        }
        let (mut ns, mut nb) = ([0i8; MAX_FACTORED_GROUPS], [0i8; MAX_FACTORED_GROUPS]);
        let supers = scales
            .chunks_exact(per)
            .zip(biases.chunks_exact(per))
            .zip(scale_part.chunks_exact_mut(2 * per))
            .zip(bias_part.chunks_exact_mut(8));
        for (((s, b), pairs), units) in supers {
            let (Some(us), Some(ub)) = (factor(s, &mut ns[..per]), factor(b, &mut nb[..per])) else {
                return false;
            };
            for ((p, &n_s), &n_b) in pairs.chunks_exact_mut(2).zip(&ns[..per]).zip(&nb[..per]) {
                p.copy_from_slice(&[n_s as u8, n_b as u8]);
            }
            units[..4].copy_from_slice(&us.to_le_bytes());
            units[4..].copy_from_slice(&ub.to_le_bytes());
        }
        true
    }

    /// The groups' scales and biases from the parts [`QuantFormat::group_bytes`] writes.
    pub fn group_values(&self, scale_part: &[u8], bias_part: &[u8]) -> (Vec<f32>, Vec<f32>) {
        if self.scale != ScaleType::Factored {
            return (self.scale.values(scale_part), self.scale.values(bias_part));
        }
        let per = self.groups_per_super();
        let mut scales = Vec::with_capacity(scale_part.len() / 2);
        let mut biases = Vec::with_capacity(scale_part.len() / 2);
        for (pairs, units) in scale_part.chunks_exact(2 * per).zip(bias_part.chunks_exact(8)) {
            let [us, ub] = [0, 1].map(|i| {
                f32::from_le_bytes([units[4 * i], units[4 * i + 1], units[4 * i + 2], units[4 * i + 3]])
            });
            for p in pairs.chunks_exact(2) {
                scales.push(us * p[0] as i8 as f32);
                biases.push(ub * p[1] as i8 as f32);
            }
        }
        (scales, biases)
    }
}

/// The most groups a super-block of a factored format may have ([`QuantFormat::group_bytes`]
/// refuses more): groups of 4 values.
const MAX_FACTORED_GROUPS: usize = SUPER_BLOCK / 4;

/// `values` as one f32 unit times signed bytes (written to `out`, as long as `values`), each
/// product exactly the value (a zero of either sign as a zero multiple), or None. The unit is
/// the largest that divides every value: writing each nonzero value as an odd integer times a
/// power of two, the greatest common divisor of the odd integers times the smallest power,
/// negated where only that fits the bytes. A k-quant's super-block (values `d * n` for its f16
/// `d` and signed bytes `n`) always factors: each multiple found is at most its `|n|`, of `n`'s
/// sign times `d`'s. Allocates nothing: a model's load factors millions of super-blocks.
fn factor(values: &[f32], out: &mut [i8]) -> Option<f32> {
    // Euclid's: a k-quant's values are mostly a few multiples of one odd number, which this
    // finds in a division or two (a binary gcd's branches cost more here).
    fn gcd(mut a: u32, mut b: u32) -> u32 {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    }
    // (negative, odd integer, exponent) of a nonzero finite value: |v| = odd * 2^exponent.
    fn parts(v: f32) -> (bool, u32, i32) {
        let bits = v.to_bits();
        let (exp, frac) = ((bits >> 23) & 0xFF, bits & 0x7F_FFFF);
        let (m, e) = if exp == 0 {
            (frac, -149)
        } else {
            (frac | 0x80_0000, exp as i32 - 150)
        };
        let tz = m.trailing_zeros();
        (v < 0.0, m >> tz, e + tz as i32)
    }
    if values.len() > MAX_FACTORED_GROUPS || out.len() != values.len() {
        return None;
    }
    let (mut g, mut e0) = (0u32, i32::MAX);
    for &v in values {
        if !v.is_finite() {
            return None;
        }
        if v != 0.0 {
            let (_, m, e) = parts(v);
            (g, e0) = (gcd(g, m), e0.min(e));
        }
    }
    if g == 0 {
        out.fill(0);
        return Some(0.0);
    }
    // Each value's multiple of the positive unit, signed, and whether all fit a signed byte.
    let mut multiples = [0i64; MAX_FACTORED_GROUPS];
    let mut fits = true;
    for (n, &v) in multiples.iter_mut().zip(values) {
        if v == 0.0 {
            continue;
        }
        let (neg, m, e) = parts(v);
        let shift = (e - e0) as u32;
        if shift > 8 {
            return None;
        }
        let k = (u64::from(m / g) << shift) as i64;
        *n = if neg { -k } else { k };
        fits &= i8::try_from(*n).is_ok();
    }
    // A negative k-quant scale times -128 is the positive unit times 128: then the negative unit.
    // g * 2^e0, exactly (e0 is from -149 to 104: a normal f64 power of two).
    let unit = (g as f64 * f64::from_bits(((e0 + 1023) as u64) << 52)) as f32;
    let (unit, sign) = if fits { (unit, 1) } else { (-unit, -1) };
    for ((o, &n), &v) in out.iter_mut().zip(&multiples).zip(values) {
        let n = i8::try_from(sign * n).ok()?;
        if unit * n as f32 != v {
            return None;
        }
        *o = n;
    }
    Some(unit)
}

/// A quantised matrix on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantMatrix {
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub weight: Vec<u32>,
    /// Group scales and biases, each exactly representable in `format.scale`.
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

impl QuantMatrix {
    /// Quantises `w` (`[rows, cols]`, row-major) in MLX's affine layout: per group, `scale =
    /// (max - min) / (2^bits - 1)` and `bias = min`, with the scale and bias rounded to the format's
    /// scale type before `q` is chosen, so dequantisation reproduces the stored affine map exactly; `q` rounds half
    /// to even, as numpy and torch do (the parity fixtures' quantiser). Factored scales are made
    /// as a k-quant's: per super-block an f16 unit of 1/127 of its largest scale (rounded up, so
    /// no group's range is cut) and of its largest bias (rounded to nearest), for weights within
    /// f16's range.
    pub fn quantize(w: &[f32], rows: usize, cols: usize, format: QuantFormat) -> QuantMatrix {
        assert!(format.fits(cols), "{cols} columns cannot be stored as {format:?}");
        assert_eq!(w.len(), rows * cols);
        let levels = ((1u32 << format.bits) - 1) as f32;
        let (vpw, gs, gpr) = (
            format.values_per_word(),
            format.group_size,
            format.groups_per_row(cols),
        );
        let mut scales = Vec::with_capacity(rows * gpr);
        let mut biases = Vec::with_capacity(scales.capacity());
        for group in w.chunks_exact(gs) {
            let (lo, hi) = group
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                    (lo.min(v), hi.max(v))
                });
            let mut scale = format.scale.round((hi - lo) / levels);
            if scale == 0.0 {
                scale = 1.0;
            }
            scales.push(scale);
            biases.push(format.scale.round(lo));
        }
        if format.scale == ScaleType::Factored {
            let per = format.groups_per_super();
            for (s, b) in scales.chunks_exact_mut(per).zip(biases.chunks_exact_mut(per)) {
                let unit = |m: f32| {
                    let u = half::f16::from_f32(m / 127.0);
                    let u = if u.to_f32() < m / 127.0 {
                        half::f16::from_bits(u.to_bits() + 1)
                    } else {
                        u
                    };
                    u.to_f32()
                };
                let us = unit(s.iter().fold(0f32, |m, v| m.max(v.abs())));
                for v in s.iter_mut() {
                    *v = us * (*v / us).ceil().min(127.0);
                }
                let ub = unit(b.iter().fold(0f32, |m, v| m.max(v.abs())));
                for v in b.iter_mut() {
                    *v = if ub == 0.0 { 0.0 } else { ub * (*v / ub).round() };
                }
            }
        }
        let mut weight = vec![0u32; rows * format.words_per_row(cols)];
        for (gi, group) in w.chunks_exact(gs).enumerate() {
            let (scale, bias) = (scales[gi], biases[gi]);
            let (r, g) = (gi / gpr, gi % gpr);
            for (i, &v) in group.iter().enumerate() {
                let q = ((v - bias) / scale).round_ties_even().clamp(0.0, levels) as u32;
                let col = g * gs + i;
                let word = r * format.words_per_row(cols) + col / vpw;
                weight[word] |= q << (format.bits as usize * (col % vpw));
            }
        }
        QuantMatrix {
            format,
            rows,
            cols,
            weight,
            scales,
            biases,
        }
    }

    /// The stored value `q` of element `(r, c)`.
    pub fn q(&self, r: usize, c: usize) -> u32 {
        let vpw = self.format.values_per_word();
        let word = self.weight[r * self.format.words_per_row(self.cols) + c / vpw];
        (word >> (self.format.bits as usize * (c % vpw))) & ((1u32 << self.format.bits) - 1)
    }

    /// `w[r, c] = q * scale + bias`, in f32.
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let g = r * self.format.groups_per_row(self.cols) + c / self.format.group_size;
        self.q(r, c) as f32 * self.scales[g] + self.biases[g]
    }

    /// The `scales` and `biases` parts as the format stores them ([`QuantFormat::group_bytes`]);
    /// None when the format cannot hold this matrix's groups exactly.
    pub fn group_bytes(&self) -> Option<(Vec<u8>, Vec<u8>)> {
        self.format.group_bytes(&self.scales, &self.biases)
    }

    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |c| (r, c)))
            .map(|(r, c)| self.get(r, c))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn packing_is_lowest_bits_first() {
        // One row of 64 values 0..15 repeating: q equals the value when min 0 and max 15.
        let w: Vec<f32> = (0..64).map(|i| (i % 16) as f32).collect();
        let m = QuantMatrix::quantize(&w, 1, 64, QuantFormat::Q4);
        assert_eq!(m.scales[0], 1.0);
        assert_eq!(m.biases[0], 0.0);
        assert_eq!(m.weight[0], 0x7654_3210);
        assert_eq!(m.weight[1], 0xFEDC_BA98);
        // 8 bits: values 0..62 and one 255 make the scale exactly 1.
        let w8: Vec<f32> = (0..64).map(|i| if i == 63 { 255.0 } else { i as f32 }).collect();
        let m8 = QuantMatrix::quantize(&w8, 1, 64, QuantFormat::Q8);
        assert_eq!(m8.scales[0], 1.0);
        assert_eq!(m8.weight[0], 0x0302_0100);
        assert_eq!(m8.weight[15], 0xFF3E_3D3C);
    }

    #[test]
    fn dequantise_error_is_within_half_a_step() {
        let (mut rng, seed) = Rng::from_time();
        for format in [
            QuantFormat::Q4,
            QuantFormat::Q8,
            QuantFormat::f32_scales(4, 32),
            QuantFormat::f32_scales(8, 16),
            QuantFormat::factored(4, 32),
            QuantFormat::factored(8, 16),
        ] {
            let (rows, cols) = (rng.range(1, 9), 256 * rng.range(1, 3));
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.symmetric()).collect();
            let m = QuantMatrix::quantize(&w, rows, cols, format);
            let d = m.dequantize();
            for r in 0..rows {
                for c in 0..cols {
                    let g = r * format.groups_per_row(cols) + c / format.group_size;
                    let step = m.scales[g];
                    // Half a step, plus the bf16 rounding of the bias and of the scale times q.
                    let mut bound = 0.5 * step + 2e-2 * (w[r * cols + c].abs() + step);
                    if format.scale == ScaleType::Factored {
                        // The bias rounded to a multiple of 1/127 of the largest (|w| <= 1).
                        bound += 0.5 / 127.0;
                    }
                    let err = (d[r * cols + c] - w[r * cols + c]).abs();
                    assert!(
                        err <= bound,
                        "seed {seed} {format:?} ({r},{c}): err {err} > {bound}"
                    );
                }
            }
        }
    }

    #[test]
    fn sizes() {
        let f = QuantFormat::Q4;
        assert_eq!(f.words_per_row(2048), 256);
        assert_eq!(f.groups_per_row(2048), 32);
        assert_eq!(f.bytes(1, 2048), 1024 + 128);
        assert!(f.fits(128) && !f.fits(100));
        assert_eq!(QuantFormat::f32_scales(4, 32).bytes(1, 2048), 1024 + 512);
        assert_eq!(QuantFormat::f32_scales(8, 16).bytes(1, 64), 64 + 32);
        // 4 bits, groups of 32: a byte pair a group and 8 bytes a super-block, 4.75 bits a value.
        let k = QuantFormat::factored(4, 32);
        assert_eq!(k.bytes(1, 2048), 1024 + 128 + 64);
        assert!(k.fits(512) && !k.fits(96) && !QuantFormat::factored(4, 48).fits(768));
    }

    /// Super-blocks as a k-quant makes them: an f16 unit times signed bytes, the bias unit
    /// sometimes a multiple of the scale unit (Q6_K's `-32 d`).
    fn k_groups(rng: &mut Rng, groups: usize, per: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut s, mut b) = (Vec::new(), Vec::new());
        for _ in 0..groups / per {
            let d = half::f16::from_f32(rng.symmetric() * 1e-2).to_f32();
            let dmin = if rng.range(0, 2) == 0 {
                -32.0 * d
            } else {
                half::f16::from_f32(rng.symmetric()).to_f32()
            };
            for _ in 0..per {
                let n = rng.range(0, 256) as i32 - 128;
                s.push(d * n as f32);
                b.push(dmin * (rng.range(0, 64) as f32));
            }
        }
        (s, b)
    }

    #[test]
    fn factored_groups_round_trip_exactly() {
        let (mut rng, seed) = Rng::from_time();
        for format in [QuantFormat::factored(4, 32), QuantFormat::factored(8, 16)] {
            let groups = format.groups_per_row(512) * rng.range(1, 6);
            let (s, b) = k_groups(&mut rng, groups, format.groups_per_super());
            let (sp, bp) = format
                .group_bytes(&s, &b)
                .unwrap_or_else(|| panic!("seed {seed} {format:?}"));
            assert_eq!(
                (sp.len(), bp.len()),
                (2 * groups, 8 * groups / format.groups_per_super())
            );
            let (s2, b2) = format.group_values(&sp, &bp);
            assert_eq!((s2, b2), (s.clone(), b.clone()), "seed {seed} {format:?}");
            // Each unit is the largest: a super-block's multiples share no factor.
            fn gcd(a: u32, b: u32) -> u32 {
                if b == 0 {
                    a
                } else {
                    gcd(b, a % b)
                }
            }
            for pairs in sp.chunks_exact(2 * format.groups_per_super()) {
                for half in 0..2 {
                    let n = pairs.iter().skip(half).step_by(2);
                    let g = n.fold(0, |g, &n| gcd(g, (n as i8).unsigned_abs() as u32));
                    assert!(g <= 1, "seed {seed} {format:?}: multiples {pairs:?} share {g}");
                }
            }
            // Written piece by piece at a super-block boundary: the same bytes.
            let per = format.groups_per_super();
            let cut = per * rng.range(0, groups / per + 1);
            let (mut sq, mut bq) = (vec![0u8; sp.len()], vec![0u8; bp.len()]);
            let (s_cut, b_cut) = format.group_parts_len(cut).unwrap();
            let (sq0, sq1) = sq.split_at_mut(s_cut);
            let (bq0, bq1) = bq.split_at_mut(b_cut);
            assert!(format.group_bytes_into(&s[..cut], &b[..cut], sq0, bq0));
            assert!(format.group_bytes_into(&s[cut..], &b[cut..], sq1, bq1));
            assert_eq!((&sq, &bq), (&sp, &bp), "seed {seed} {format:?} cut at {cut}");
            // Parts of the wrong length, or groups that are not whole super-blocks: refused.
            assert!(!format.group_bytes_into(&s, &b, &mut sq[1..], &mut bq));
            assert_eq!(format.group_parts_len(per + 1), None);
        }
        // Zeros, subnormals and values no one unit multiplies.
        let f = QuantFormat::factored(8, 32);
        let tiny = f32::from_bits(3);
        let mut s = vec![0.0f32; 8];
        s[1] = tiny;
        s[2] = -5.0 * tiny;
        let (sp, bp) = f.group_bytes(&s, &[0.0; 8]).expect("subnormal multiples factor");
        assert_eq!(f.group_values(&sp, &bp).0, s);
        // A negative unit times -128 (Q6_K's scale bytes are signed): only the negative unit fits.
        let neg = [-0.5 * -128.0, -0.5, 0.0, -0.5 * 127.0, 0.0, 0.0, 0.0, 0.0];
        let (sp, bp) = f
            .group_bytes(&neg, &[0.0; 8])
            .expect("a negative unit's multiples factor");
        assert_eq!(f.group_values(&sp, &bp).0, neg);
        assert_eq!(f32::from_le_bytes(bp[..4].try_into().unwrap()), -0.5);
        let mut odd = vec![1.0f32; 8];
        odd[0] = 1.0 + f32::EPSILON;
        assert!(f.group_bytes(&odd, &[0.0; 8]).is_none());
        assert!(f
            .group_bytes(&[300.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], &[0.0; 8])
            .is_none());
        assert!(f.group_bytes(&[f32::NAN; 8], &[0.0; 8]).is_none());
        // Plain types refuse values they would round.
        assert!(QuantFormat::Q4
            .group_bytes(&[1.0 + f32::EPSILON], &[0.0])
            .is_none());
    }
}
