//! GGUF tensor data as values: the float types as they are, and ggml's block-quantised types
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) dequantised to f32 with ggml's own formulas,
//! in ggml's order of operations, so every value is the one llama.cpp computes for it. Other
//! types are refused with the supported ones named: nothing is re-quantised silently.

use half::{bf16, f16};

use crate::gguf::GgmlType;

/// The types [`dequantize`] reads, by ggml name.
pub const SUPPORTED: &[&str] = &[
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
];

/// Values of a super-block of the K types.
const QK_K: usize = 256;

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

/// One block of `ty` (its `block_bytes` bytes) into `out` (its `block` values).
fn block(ty: &str, b: &[u8], out: &mut [f32]) {
    match ty {
        "Q4_0" => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                out[j] = ((b[2 + j] & 0x0F) as i32 - 8) as f32 * d;
                out[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        "Q4_1" => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for j in 0..16 {
                out[j] = (b[4 + j] & 0x0F) as f32 * d + m;
                out[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
            }
        }
        "Q5_0" | "Q5_1" => {
            let one = ty == "Q5_1";
            let d = f16_at(b, 0);
            let m = if one { f16_at(b, 2) } else { 0.0 };
            let at = if one { 4 } else { 2 };
            let qh = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
            let qs = &b[at + 4..at + 20];
            for j in 0..16 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                let (x0, x1) = ((qs[j] & 0x0F) | h0, (qs[j] >> 4) | h1);
                if one {
                    out[j] = x0 as f32 * d + m;
                    out[j + 16] = x1 as f32 * d + m;
                } else {
                    out[j] = (x0 as i32 - 16) as f32 * d;
                    out[j + 16] = (x1 as i32 - 16) as f32 * d;
                }
            }
        }
        "Q8_0" => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                out[j] = b[2 + j] as i8 as f32 * d;
            }
        }
        "Q4_K" | "Q5_K" => {
            let five = ty == "Q5_K";
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, mut ql) = if five {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            let mut y = 0;
            for (is, (u1, u2)) in (0..4).map(|i| (2 * i, (1u8 << (2 * i), 2u8 << (2 * i)))) {
                let (sc, m) = scale_min_k4(is, scales);
                let (d1, m1) = (d * sc as f32, dmin * m as f32);
                let (sc, m) = scale_min_k4(is + 1, scales);
                let (d2, m2) = (d * sc as f32, dmin * m as f32);
                let high = |l: usize, u: u8| if five && qh[l] & u != 0 { 16 } else { 0 };
                for l in 0..32 {
                    out[y + l] = d1 * ((ql[l] & 0x0F) + high(l, u1)) as f32 - m1;
                }
                for l in 0..32 {
                    out[y + 32 + l] = d2 * ((ql[l] >> 4) + high(l, u2)) as f32 - m2;
                }
                y += 64;
                ql = &ql[32..];
            }
        }
        "Q6_K" => {
            let (mut ql, mut qh) = (&b[0..128], &b[128..192]);
            let mut sc = &b[192..208];
            let d = f16_at(b, 208);
            for half in 0..2 {
                let y = &mut out[half * 128..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    let s = |k: usize| d * sc[is + k] as i8 as f32;
                    y[l] = s(0) * q1 as f32;
                    y[l + 32] = s(2) * q2 as f32;
                    y[l + 64] = s(4) * q3 as f32;
                    y[l + 96] = s(6) * q4 as f32;
                }
                ql = &ql[64..];
                qh = &qh[32..];
                sc = &sc[8..];
            }
        }
        _ => unreachable!("checked by dequantize"),
    }
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
    let len = bytes.len() / per * n;
    let mut out = Vec::new();
    out.try_reserve_exact(len).map_err(|_| {
        format!(
            "{} MiB for its values as f32 could not be allocated",
            (len * 4) >> 20
        )
    })?;
    out.resize(len, 0f32);
    match ty.name {
        "F32" => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
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
            debug_assert!(n == 32 || n == QK_K);
            for (o, b) in out.chunks_exact_mut(n).zip(bytes.chunks_exact(per)) {
                block(name, b, o);
            }
        }
    }
    Ok(out)
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
    }
}
