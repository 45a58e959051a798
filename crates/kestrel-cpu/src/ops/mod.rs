//! One module per op family; [`exec`] hands each op to its family.

pub mod attention;
pub mod deltanet;
pub mod elementwise;
pub mod head;
pub mod linear;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod stream;

use kestrel_core::ir::Op;

use crate::views::Views;

pub type OpResult = Result<(), String>;

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    use Op::*;
    match op {
        Embed { .. } | Linear { .. } => linear::exec(op, v),
        RmsNorm { .. } | AddRmsNorm { .. } | GatedRmsNorm { .. } => norm::exec(op, v),
        Rope { .. } => rope::exec(op, v),
        Split { .. } | Concat { .. } | SwiGlu { .. } | SigmoidGate { .. } | Add { .. } | CopyRows { .. } => {
            elementwise::exec(op, v)
        }
        KvAppend { .. } | AttentionInputs { .. } | Attention { .. } => attention::exec(op, v),
        Router { .. } | MoeExperts { .. } => moe::exec(op, v),
        ExpertFetch { .. } | ExpertStage { .. } | ExpertStageAll { .. } => stream::exec(op, v),
        CausalConv1d { .. } | DeltaGates { .. } | DeltaRule { .. } => deltanet::exec(op, v),
        Argmax { .. } | TopK { .. } | SampleRows { .. } => head::exec(op, v),
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}
