//! Rotary embeddings, neox style: dims `i` and `i + rot/2` of each head rotate together by
//! `positions[t] * inv_freq[i]`; dims past `rot_dim` pass through.

use kestrel_core::ir::Op;

use super::OpResult;
use crate::views::Views;

/// cos and sin of `position * inv_freq[i]`, scaled, in f32 as transformers computes them.
pub(super) fn angles(position: u32, inv_freq: &[f32], scaling: f32) -> (Vec<f32>, Vec<f32>) {
    inv_freq
        .iter()
        .map(|f| {
            let a = position as f32 * f;
            (a.cos() * scaling, a.sin() * scaling)
        })
        .unzip()
}

/// Rotates one head in place by the angles of `angles` (its first `2 * cos.len()` dims).
pub(super) fn rotate(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (x1, x2) = (head[i], head[i + half]);
        head[i] = x1 * cos[i] - x2 * sin[i];
        head[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    let Op::Rope {
        x,
        positions,
        inv_freq,
        heads,
        head_dim,
        rot_dim,
        scaling,
    } = *op
    else {
        return Err(format!("{} is not rope", op.name()));
    };
    let (pos, inv_freq) = (v.read::<u32>(positions)?, v.read::<f32>(inv_freq)?);
    let x = v.write::<f32>(x)?; // [tokens, heads, head_dim]
    let inv_freq = &inv_freq[..rot_dim / 2];
    for (t, row) in x.chunks_mut(heads * head_dim).enumerate() {
        let (cos, sin) = angles(pos[t], inv_freq, scaling);
        for head in row.chunks_mut(head_dim) {
            rotate(head, &cos, &sin);
        }
    }
    Ok(())
}
