//! A router's product and choice for many tokens, bounded first: `moe.cu`'s `router_bounds_*`
//! estimates every logit on the tensor cores with a bound on its distance from the exact one,
//! and `router_choose_*` computes exactly (the one-token kernel's arithmetic) only the logits of
//! experts whose bounds let them be among the top k, then chooses from those. The experts and
//! weights are bit for bit those of the exact product of every logit and `router_f32_*`.

use kestrel_core::ir::{BufKind, LinearWeight, Op};
use kestrel_core::quant::ScaleType;
use kestrel_core::DType;

use kestrel_cuda_rt::Result;

use super::common::{padded_len, u32_arg};
use super::linear::weight_parts;
use super::moe::{
    router_per_lane, RouterPair, MODULE, RB_EXPERTS, RB_K, RB_SPLITS, RB_THREADS, RB_TOKENS, RC_WARPS,
};
use crate::encoder::Encoder;

/// From this many tokens a router's logits are bounded first (fewer take the exact product of
/// every logit, `matvec_*_exact_tokens_*`, or the one-token kernels). On the H200, Qwen3-30B-A3B:
/// prefills of 512, 1,024 and 2,048 tokens gained 1.2%, 2.4% and 3.3%, while 256 lost 4% and
/// batched steps of 64 and 128 sequences 2-3% (both kernels wait out their latencies there).
const BOUNDED_MIN_TOKENS: usize = 512;

/// Floats of shared memory a `router_choose_*` block takes (`rc_floats` in moe.cu).
fn rc_floats(in_dim: usize, vals: usize, experts: usize) -> usize {
    (padded_len(in_dim) + in_dim / vals + 4 * experts + 1).next_multiple_of(4)
}

/// The factor `router_choose_*` takes the bound `m` by: however far the estimate and the exact
/// logit each lie from the real product, in units of 2^-24 m per rounding (an mma's error under
/// 2^-23 of its terms counts twice) along the longest chain of each, counted four times over.
/// The estimate: the split of x, a group's mmas (three a 16-value segment), the sums of x over a
/// group, the fold, the groups and the splits added up. The exact kernel: a vector's products,
/// its scale and bias, a lane's vectors, warp_sum's five levels, the vector's plain sum of x.
fn beta(in_dim: usize, group: usize, vals: usize, splits: usize) -> f32 {
    let estimate = 1 + 2 * (3 * group / 16) + (group / 16 + 9) + 3 + in_dim / group + splits;
    let exact = vals + 2 + (in_dim / vals).div_ceil(32) + 5 + (vals / 4 + 2);
    4.0 * (estimate + exact) as f32 * (-24f32).exp2()
}

/// A router's product (`linear`, writing the logits) and its choice (`router`) as
/// `router_bounds_*` and `router_choose_*`, when: the device allows it (`Config::bounded_router`,
/// compute capability 8 or newer), at least `BOUNDED_MIN_TOKENS` tokens, 4- or 8-bit weights
/// with bf16 or f32 group scales of whole 16-value segments and 16-byte vectors, K in whole
/// steps, the choice renormalised over the top k (so only the chosen logits weigh), and the
/// logits a transient nothing else reads (they are left estimates, not exact). Returns false,
/// recording nothing, otherwise.
pub fn encode_bounded(linear: &Op, router: &Op, enc: &mut Encoder) -> Result<bool> {
    let Some(p) = RouterPair::of(linear, router) else {
        return Ok(false);
    };
    let LinearWeight::Quant { format, .. } = p.w else {
        return Ok(false);
    };
    let (tokens, in_dim, experts) = (p.tokens, p.in_dim, p.experts);
    let vals = 128 / format.bits as usize;
    if !enc.device.bounded_router()
        || enc.device.info().compute_capability.0 < 8
        || tokens < BOUNDED_MIN_TOKENS
        || !p.normalize
        || !matches!(format.bits, 4 | 8)
        || !matches!(format.scale, ScaleType::Bf16 | ScaleType::F32)
        || format.group_size % 16 != 0
        || format.group_size % vals != 0
        || in_dim % format.group_size != 0
        || in_dim % RB_K != 0
        || enc.graph.decl(p.logits).kind != BufKind::Transient
        || enc.readers(p.logits).len() != 1
        || enc.dtype(p.x) != DType::F32
        || enc.held_dtype(p.x) != DType::F32
    {
        return Ok(false);
    }
    let smem = rc_floats(in_dim, vals, experts) * 4;
    let xb = enc.buf(p.x)?.clone();
    if xb.device_ptr() % 16 != 0 || smem > enc.device.info().max_shared_per_block {
        return Ok(false);
    }
    let (name, parts, _) = weight_parts(enc, p.w)?;
    let (ids, weights) = (enc.buf(p.ids)?.clone(), enc.buf(p.weights)?.clone());
    // Split K so that the blocks fill the GPU about twice over, into at most RB_SPLITS
    // ranges (each a partial sum the choice reads).
    let sms = enc.device.info().sm_count as usize;
    let tiles = tokens.div_ceil(RB_TOKENS) * experts.div_ceil(RB_EXPERTS);
    let steps_all = in_dim / RB_K;
    let want = (2 * sms).div_ceil(tiles).clamp(1, RB_SPLITS.min(steps_all));
    let steps = steps_all.div_ceil(want);
    let splits = steps_all.div_ceil(steps);
    let approx = enc.workspace(DType::F32, splits * tokens * experts)?;
    let bound = enc.workspace(DType::F32, splits * tokens * experts)?;
    let bounds = enc.kernel(&MODULE, &format!("router_bounds_{name}"))?;
    let mut b = enc
        .dispatch(&bounds)
        .grid((
            u32_arg(tokens.div_ceil(RB_TOKENS))?,
            u32_arg(experts.div_ceil(RB_EXPERTS))?,
            u32_arg(splits)?,
        ))
        .block(RB_THREADS as u32)
        .read(&xb);
    for p in &parts {
        b = b.read(p);
    }
    b.write(&approx)
        .write(&bound)
        .arg(u32_arg(tokens)?)
        .arg(u32_arg(in_dim)?)
        .arg(u32_arg(experts)?)
        .arg(u32_arg(format.group_size)?)
        .arg(u32_arg(steps)?)
        .record();
    let choose = enc.kernel(
        &MODULE,
        &format!("router_choose_{name}_{}", router_per_lane(experts)),
    )?;
    let mut b = enc
        .dispatch(&choose)
        .grid(u32_arg(tokens)?)
        .block(u32_arg(32 * RC_WARPS)?)
        .shared_mem(u32_arg(smem)?)
        .read(&xb);
    for p in &parts {
        b = b.read(p);
    }
    b.read(&approx)
        .read(&bound)
        .arg(u32_arg(splits)?)
        .arg(beta(in_dim, format.group_size, vals, splits))
        .write(&ids)
        .write(&weights)
        .arg(u32_arg(tokens)?)
        .arg(u32_arg(in_dim)?)
        .arg(u32_arg(experts)?)
        .arg(u32_arg(format.group_size)?)
        .arg(u32_arg(p.k)?)
        .record();
    Ok(true)
}
