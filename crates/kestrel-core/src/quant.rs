//! Affine quantisation in the MLX layout, on the host.
//!
//! A row of `cols` weights is cut into groups of `group_size`; each group has a `scale` and a
//! `bias`, and each weight is stored as `q` in `bits` bits with `w = q * scale + bias`.
//! Values are packed into little-endian `u32` words, lowest bits first: with 4 bits a word holds
//! 8 values, with 8 bits 4. A `[rows, cols]` matrix becomes `weight: u32 [rows, cols * bits / 32]`,
//! `scales` and `biases: [rows, cols / group_size]`, in bf16 as MLX stores them, or in f32 for
//! what bf16 cannot hold exactly (GGUF's block formats: a k-quant's scale is an f16 times a 6-bit
//! integer).

use half::bf16;

/// How a quantised matrix stores its group scales and biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleType {
    Bf16,
    F32,
}

impl ScaleType {
    pub fn size_in_bytes(&self) -> usize {
        match self {
            ScaleType::Bf16 => 2,
            ScaleType::F32 => 4,
        }
    }

    /// `v` as this type stores it.
    pub fn round(&self, v: f32) -> f32 {
        match self {
            ScaleType::Bf16 => bf16::from_f32(v).to_f32(),
            ScaleType::F32 => v,
        }
    }

    /// The little-endian bytes of `values` in this type (each already representable).
    pub fn bytes(&self, values: &[f32]) -> Vec<u8> {
        match self {
            ScaleType::Bf16 => values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            ScaleType::F32 => values.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        }
    }

    /// Values from little-endian bytes of this type.
    pub fn values(&self, bytes: &[u8]) -> Vec<f32> {
        match self {
            ScaleType::Bf16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            ScaleType::F32 => bytes
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
    }

    /// Bytes of weight, scales and biases for a `[rows, cols]` matrix.
    pub fn bytes(&self, rows: usize, cols: usize) -> usize {
        rows * (self.words_per_row(cols) * 4 + self.groups_per_row(cols) * 2 * self.scale.size_in_bytes())
    }
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
    /// to even, as numpy and torch do (the parity fixtures' quantiser).
    pub fn quantize(w: &[f32], rows: usize, cols: usize, format: QuantFormat) -> QuantMatrix {
        assert!(format.fits(cols), "{cols} columns cannot be stored as {format:?}");
        assert_eq!(w.len(), rows * cols);
        let levels = ((1u32 << format.bits) - 1) as f32;
        let vpw = format.values_per_word();
        let mut weight = vec![0u32; rows * format.words_per_row(cols)];
        let mut scales = Vec::with_capacity(rows * format.groups_per_row(cols));
        let mut biases = Vec::with_capacity(scales.capacity());
        for r in 0..rows {
            for g in 0..format.groups_per_row(cols) {
                let start = r * cols + g * format.group_size;
                let group = &w[start..start + format.group_size];
                let (lo, hi) = group
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                        (lo.min(v), hi.max(v))
                    });
                let mut scale = format.scale.round((hi - lo) / levels);
                if scale == 0.0 {
                    scale = 1.0;
                }
                let bias = format.scale.round(lo);
                scales.push(scale);
                biases.push(bias);
                for (i, &v) in group.iter().enumerate() {
                    let q = ((v - bias) / scale).round_ties_even().clamp(0.0, levels) as u32;
                    let col = g * format.group_size + i;
                    let word = r * format.words_per_row(cols) + col / vpw;
                    weight[word] |= q << (format.bits as usize * (col % vpw));
                }
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

    /// The scales' bytes as the format stores them.
    pub fn scale_bytes(&self) -> Vec<u8> {
        self.format.scale.bytes(&self.scales)
    }

    pub fn bias_bytes(&self) -> Vec<u8> {
        self.format.scale.bytes(&self.biases)
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
        ] {
            let (rows, cols) = (rng.range(1, 9), 64 * rng.range(1, 5));
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.symmetric()).collect();
            let m = QuantMatrix::quantize(&w, rows, cols, format);
            let d = m.dequantize();
            for r in 0..rows {
                for c in 0..cols {
                    let g = r * format.groups_per_row(cols) + c / format.group_size;
                    let step = m.scales[g];
                    // Half a step, plus the bf16 rounding of the bias and of the scale times q.
                    let bound = 0.5 * step + 2e-2 * (w[r * cols + c].abs() + step);
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
    }
}
