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
mod stream;

pub(crate) use linear::GEMM_MIN_TOKENS;

use kestrel_core::ir::Op;
use kestrel_cuda_rt::{ModuleSource, Result};

use crate::encoder::Encoder;

/// Every kernel module the backend ships, one per op family (`kernels/<name>.cu`), with the
/// headers and definitions each is compiled with.
pub const MODULES: &[ModuleSource] = &[
    norm::MODULE,
    norm::ROPE_MODULE,
    linear::MODULE,
    elementwise::MODULE,
    attention::MODULE,
    moe::MODULE,
    gemm::MODULE,
    deltanet::MODULE,
    head::MODULE,
    stream::MODULE,
];

/// Encodes the first nodes of `ops` together when kernels do them together: a one-token
/// router's residual add and norm, product and choice of experts (three), or its product and
/// choice (two), each optionally with a streamed layer's fetch of the chosen experts and the
/// experts that read the fetched slots after them (two more). Returns how many it encoded; 0,
/// and nothing recorded, otherwise.
pub fn encode_fused(ops: &[&Op], enc: &mut Encoder) -> Result<usize> {
    let is_fetch = |op: &Op| matches!(op, Op::ExpertFetch { .. });
    // The longest run first: with the norm or without, with the fetch and its experts or
    // without.
    for norm in [true, false] {
        let (head, rest) = if norm {
            match ops {
                [n, l, r, rest @ ..] => ((Some(*n), *l, *r), rest),
                _ => continue,
            }
        } else {
            match ops {
                [l, r, rest @ ..] => ((None, *l, *r), rest),
                _ => continue,
            }
        };
        let (n, l, r) = head;
        let base = 2 + norm as usize;
        let tails: &[(Option<&Op>, Option<&Op>, usize)] = match rest {
            [f, e, ..] if is_fetch(f) => &[(Some(*f), Some(*e), 2), (None, None, 0)],
            _ => &[(None, None, 0)],
        };
        for &(fetch, experts, more) in tails {
            if moe::encode_route(n, l, r, fetch, experts, enc)? {
                return Ok(base + more);
            }
        }
    }
    Ok(0)
}

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
        Argmax { .. } | TopK { .. } | Sample { .. } => head::encode(op, enc),
    }
}
