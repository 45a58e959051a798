//! Streamed experts: `ExpertFetch` and `ExpertStage`, `kernels/stream.cu`. A one-token fetch
//! between a one-token router and its experts is resolved by the router's kernel and its misses
//! read by the experts' kernels (`moe::encode_route`); any other fetch is one kernel that resolves the layer's slots
//! on the GPU and copies the misses from mapped host memory, and a commit of the next books
//! beside the experts' kernels; a stage lists a longer chunk's experts and copies each from its
//! slot or from host memory.

use kestrel_core::expert_slots::{book_words, HEADER, USE};
use kestrel_core::ir::Op;
use kestrel_core::DType;

use super::common::{op_module, u32_arg, unsupported};
use kestrel_cuda_rt::{ModuleSource, Result};

use crate::encoder::Encoder;

/// Most ids one fetch resolves (its shared-memory lists).
const MAX_IDS: usize = 1024;
/// Most experts a streamed layer has and most slots its cache has (the books, in shared
/// memory while a fetch resolves, and the stage plan's flags).
const MAX_EXPERTS: usize = 1024;
pub(crate) const MAX_SLOTS: usize = 1024;
/// Threads of a fetch's blocks (one warp of each resolves, all of them copy).
const FETCH_THREADS: u32 = 256;
/// Blocks that copy one span: a fetch has a few misses, so each gets many blocks to keep the
/// link busy; a stage lists up to every expert of the layer.
const FETCH_BLOCKS_PER_SPAN: u32 = 16;
const STAGE_BLOCKS_PER_SPAN: u32 = 4;
const COPY_THREADS: u32 = 256;
/// Blocks of a whole layer's staging, which runs beside the kernels of the layers before: few
/// enough to leave them the SMs, with enough loads in flight to keep the link busy.
const STAGE_ALL_BLOCKS: u32 = 32;
const STAGE_ALL_THREADS: u32 = 512;

pub(crate) const MODULE: ModuleSource = op_module(
    "stream",
    include_str!("../../kernels/stream.cu"),
    &[
        ("SLOTS_HEADER", HEADER as i64),
        ("SLOTS_USE", USE as i64),
        ("STREAM_MAX_IDS", MAX_IDS as i64),
        ("STREAM_MAX_SLOTS", MAX_SLOTS as i64),
        ("STREAM_MAX_EXPERTS", MAX_EXPERTS as i64),
    ],
);

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match *op {
        Op::ExpertFetch {
            ids,
            table,
            src,
            cache,
            out,
            tokens,
            k,
            experts,
            slots,
            span,
            policy,
        } => {
            let n = tokens * k;
            if n > MAX_IDS || slots > MAX_SLOTS || experts > MAX_EXPERTS {
                return Err(unsupported(format!(
                    "{n} expert ids at once, {slots} slots, {experts} experts (at most {MAX_IDS}, \
                     {MAX_SLOTS}, {MAX_EXPERTS})"
                )));
            }
            let (ids, table, src) = (
                enc.buf(ids)?.clone(),
                enc.buf(table)?.clone(),
                enc.buf(src)?.clone(),
            );
            let (cache, out) = (enc.buf(cache)?.clone(), enc.buf(out)?.clone());
            // The books and their second copy, which the fetch writes and the commit reads.
            let words = book_words(slots, experts);
            let books = table.view(0, DType::U32, words)?;
            let next = table.view(words * 4, DType::U32, words)?;
            let fetch = enc.kernel(&MODULE, "expert_fetch")?;
            enc.dispatch(&fetch)
                .grid((FETCH_BLOCKS_PER_SPAN, u32_arg(n)?))
                .block(FETCH_THREADS)
                .read(&ids)
                .arg(u32_arg(n)?)
                .read(&books)
                .write(&next)
                .arg(u32_arg(slots)?)
                .arg(u32_arg(experts)?)
                .arg(policy.half_life())
                .write(&out)
                .read(&src)
                .write(&cache)
                .arg((span / 16) as u64)
                .record();
            let commit = enc.kernel(&MODULE, "expert_commit")?;
            enc.dispatch(&commit)
                .grid(1)
                .block(FETCH_THREADS)
                .read_write(&table)
                .arg(u32_arg(words)?)
                .record();
            Ok(())
        }
        Op::ExpertStage {
            ids,
            table,
            src,
            cache,
            staging,
            tokens,
            k,
            experts,
            slots,
            span,
        } => {
            if experts > MAX_EXPERTS {
                return Err(unsupported(format!(
                    "{experts} experts in a layer (at most {MAX_EXPERTS})"
                )));
            }
            let (ids, table, src) = (
                enc.buf(ids)?.clone(),
                enc.buf(table)?.clone(),
                enc.buf(src)?.clone(),
            );
            let (cache, staging) = (enc.buf(cache)?.clone(), enc.buf(staging)?.clone());
            let list = enc.workspace(DType::U32, 1 + 2 * experts)?;
            let plan = enc.kernel(&MODULE, "expert_stage_plan")?;
            enc.dispatch(&plan)
                .grid(1)
                .block(512)
                .read(&ids)
                .arg(u32_arg(tokens * k)?)
                .read_write(&table)
                .arg(u32_arg(slots)?)
                .arg(u32_arg(experts)?)
                .write(&list)
                .record();
            let kern = enc.kernel(&MODULE, "expert_copy")?;
            enc.dispatch(&kern)
                .grid((STAGE_BLOCKS_PER_SPAN, u32_arg(experts)?))
                .block(COPY_THREADS)
                .read(&list)
                .read(&src)
                .read(&cache)
                .write(&staging)
                .arg((span / 16) as u64)
                .record();
            Ok(())
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
            if experts > MAX_EXPERTS {
                return Err(unsupported(format!(
                    "{experts} experts in a layer (at most {MAX_EXPERTS})"
                )));
            }
            let (table, src) = (enc.buf(table)?.clone(), enc.buf(src)?.clone());
            let (cache, staging) = (enc.buf(cache)?.clone(), enc.buf(staging)?.clone());
            let kern = enc.kernel(&MODULE, "expert_stage_all")?;
            enc.dispatch(&kern)
                .grid(STAGE_ALL_BLOCKS)
                .block(STAGE_ALL_THREADS)
                .read_write(&table)
                .arg(u32_arg(slots)?)
                .arg(u32_arg(experts)?)
                .read(&src)
                .read(&cache)
                .write(&staging)
                .arg((span / 16) as u64)
                .record();
            Ok(())
        }
        _ => Err(unsupported(format!("not a streaming op: {}", op.name()))),
    }
}
