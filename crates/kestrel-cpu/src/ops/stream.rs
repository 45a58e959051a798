//! Streamed experts: a layer's cache of expert slots resolved and filled (`ExpertFetch`), and a
//! longer chunk's experts staged (`ExpertStage`, or the whole layer: `ExpertStageAll`), by
//! `kestrel_core::expert_slots`, the algorithm the CUDA kernels follow too.

use kestrel_core::expert_slots::{resolve, stage_sources};
use kestrel_core::ir::{Buf, Op};

use super::OpResult;
use crate::views::Views;

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    match *op {
        Op::ExpertFetch {
            ids,
            table,
            src,
            cache,
            out,
            experts,
            slots,
            span,
            policy,
            ..
        } => {
            let ids = v.read::<u32>(ids)?;
            let src = v.bytes(src)?;
            let table = v.write::<u32>(table)?;
            let out = v.write::<u32>(out)?;
            let cache = v.write_bytes(cache)?;
            for f in resolve(table, slots, experts, policy, ids, out)? {
                let (s, e) = (f.slot as usize * span, f.expert as usize * span);
                cache[s..s + span].copy_from_slice(&src[e..e + span]);
            }
            Ok(())
        }
        Op::ExpertStage {
            ids,
            table,
            src,
            cache,
            staging,
            experts,
            slots,
            span,
            ..
        } => {
            let ids = v.read::<u32>(ids)?.to_vec();
            stage(v, (table, src, cache, staging), (experts, slots, span), &ids)
        }
        Op::ExpertStageAll {
            table,
            src,
            cache,
            staging,
            experts,
            slots,
            span,
        } => {
            let all: Vec<u32> = (0..experts as u32).collect();
            stage(v, (table, src, cache, staging), (experts, slots, span), &all)
        }
        _ => Err(format!("not a streaming op: {}", op.name())),
    }
}

/// Copies every expert `ids` names to its index of `staging`, from its slot of `cache` where
/// the books of `table` say one holds it, else from `src`.
fn stage(
    v: &mut Views,
    (table, src, cache, staging): (Buf, Buf, Buf, Buf),
    (experts, slots, span): (usize, usize, usize),
    ids: &[u32],
) -> OpResult {
    let (src, cache) = (v.bytes(src)?, v.bytes(cache)?);
    let table = v.write::<u32>(table)?;
    let staging = v.write_bytes(staging)?;
    for (e, slot) in stage_sources(table, slots, experts, ids)? {
        let from = match slot {
            Some(s) => &cache[s as usize * span..(s as usize + 1) * span],
            None => &src[e as usize * span..(e as usize + 1) * span],
        };
        staging[e as usize * span..(e as usize + 1) * span].copy_from_slice(from);
    }
    Ok(())
}
