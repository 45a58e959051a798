//! One module per op family, each encoding its ops into dispatches of its `kernels/<family>.cu`
//! (`gemm.rs` owns the tile geometry the tensor-core products share); `common.rs` holds what
//! they all use. The table in ARCHITECTURE.md maps each op to its file and kernels.

mod attention;
mod common;
mod deltanet;
mod elementwise;
mod gemm;
mod head;
mod linear;
mod moe;
mod norm;
mod router;
mod skinny;
mod stream;

pub(crate) use linear::{dequant_format_fits, GEMM_MIN_TOKENS};

use kestrel_core::ir::Op;
use kestrel_cuda_rt::{ModuleSource, Result};

use crate::encoder::Encoder;

/// Every kernel module the backend ships, one per op family (`kernels/<name>.cu`; `skinny.cu`
/// as several, `skinny.<part>`), with the headers and definitions each is compiled with.
pub const MODULES: &[ModuleSource] = &[
    norm::MODULE,
    norm::ROPE_MODULE,
    linear::MODULE,
    elementwise::MODULE,
    attention::MODULE,
    moe::MODULE,
    gemm::MODULE,
    skinny::MODULES[0],
    skinny::MODULES[1],
    skinny::MODULES[2],
    skinny::MODULES[3],
    skinny::MODULES[4],
    skinny::MODULES[5],
    skinny::MODULES[6],
    deltanet::MODULE,
    head::MODULE,
    stream::MODULE,
];

/// Encodes the first nodes of `ops` together when kernels do them together: one token's inputs
/// of attention and its attention (two); a few tokens' router: residual add and norm, product and
/// choice of experts (three), or product and choice (two), for one token optionally with a
/// streamed layer's fetch of the chosen experts and the experts that read the fetched slots
/// after them (two more); many tokens' router product and choice, the logits bounded first and
/// computed exactly only where they decide (two); one token's norm and the quantised product
/// that reads it (two).
/// `precise` says, for each of `ops`, whether its output feeds a router's choice. Returns how
/// many it encoded; 0, and nothing recorded, otherwise.
pub fn encode_fused(ops: &[&Op], precise: &[bool], enc: &mut Encoder) -> Result<usize> {
    // One token's inputs of attention and its attention.
    if let [inputs @ Op::AttentionInputs { .. }, attention @ Op::Attention { .. }, ..] = ops {
        if attention::encode_inputs_and_decode(inputs, attention, enc)? {
            return Ok(2);
        }
    }
    // The longest run first: with the norm or without, then with the fetch and its experts or
    // without.
    for norm in [true, false] {
        let head = 2 + norm as usize;
        let Some(route) = ops.get(..head) else {
            continue;
        };
        let (n, l, r) = match route {
            [n, l, r] => (Some(*n), *l, *r),
            [l, r] => (None, *l, *r),
            _ => unreachable!("the head is two or three nodes"),
        };
        if let [f @ Op::ExpertFetch { .. }, e, ..] = &ops[head..] {
            if moe::encode_route(n, l, r, Some(f), Some(e), enc)? {
                return Ok(head + 2);
            }
        }
        if moe::encode_route(n, l, r, None, None, enc)? {
            return Ok(head);
        }
    }
    // Many tokens' router product and choice, bounded first.
    if let [linear @ Op::Linear { .. }, router @ Op::Router { .. }, ..] = ops {
        if router::encode_bounded(linear, router, enc)? {
            return Ok(2);
        }
    }
    // One token's norm and the quantised product that reads it (after the router's, which
    // takes its norm itself).
    if let ([norm, linear, ..], [_, linear_precise, ..]) = (ops, precise) {
        if linear::encode_norm_matvec(norm, linear, *linear_precise, enc)? {
            return Ok(2);
        }
    }
    Ok(0)
}

/// The most nodes `encode_fused` encodes together: the norm, product, choice, fetch and experts.
pub const FUSED_MAX_NODES: usize = 5;

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    use Op::*;
    match op {
        Embed { .. } | Linear { .. } => linear::encode(op, enc),
        RmsNorm { .. } | AddRmsNorm { .. } | GatedRmsNorm { .. } | Rope { .. } => norm::encode(op, enc),
        Split { .. } | Concat { .. } | SwiGlu { .. } | SigmoidGate { .. } | Add { .. } | CopyRows { .. } => {
            elementwise::encode(op, enc)
        }
        KvAppend { .. } | AttentionInputs { .. } | Attention { .. } => attention::encode(op, enc),
        Router { .. } | MoeExperts { .. } => moe::encode(op, enc),
        ExpertFetch { .. } | ExpertStage { .. } | ExpertStageAll { .. } => stream::encode(op, enc),
        CausalConv1d { .. } | DeltaGates { .. } | DeltaRule { .. } => deltanet::encode(op, enc),
        Argmax { .. } | TopK { .. } | SampleRows { .. } => head::encode(op, enc),
    }
}
