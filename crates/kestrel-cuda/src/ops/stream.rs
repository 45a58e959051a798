//! Streamed experts: `ExpertFetch` and `ExpertStage`, `kernels/stream.cu`. A fetch resolves the
//! layer's slots on the GPU (one warp) and copies the misses from mapped host memory; a stage
//! lists a longer chunk's experts and copies each from its slot or from host memory.

use kestrel_core::expert_slots::{HEADER, USE};
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
const MAX_SLOTS: usize = 1024;
/// Threads that load and store a fetch's books (one warp of them resolves).
const RESOLVE_THREADS: u32 = 256;
/// Blocks that copy one listed span: a fetch lists a few misses, so each gets many blocks to
/// keep the link busy; a stage lists up to every expert of the layer.
const FETCH_BLOCKS_PER_SPAN: u32 = 16;
const STAGE_BLOCKS_PER_SPAN: u32 = 4;
const COPY_THREADS: u32 = 256;

pub(crate) const MODULE: ModuleSource = op_module(
    "stream",
    include_str!("../../kernels/stream.cu"),
    &[
        ("STREAM_HEADER", HEADER as i64),
        ("STREAM_USE", USE as i64),
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
            let list = enc.workspace(DType::U32, 1 + 2 * n)?;
            let resolve = enc.kernel(&MODULE, "expert_resolve")?;
            enc.dispatch(&resolve)
                .grid(1)
                .block(RESOLVE_THREADS)
                .read(&ids)
                .arg(u32_arg(n)?)
                .read_write(&table)
                .arg(u32_arg(slots)?)
                .arg(u32_arg(experts)?)
                .arg(policy.half_life())
                .write(&out)
                .write(&list)
                .record();
            copy(enc, &list, &src, &cache, &cache, n, FETCH_BLOCKS_PER_SPAN, span)
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
            copy(
                enc,
                &list,
                &src,
                &cache,
                &staging,
                experts,
                STAGE_BLOCKS_PER_SPAN,
                span,
            )
        }
        _ => Err(unsupported(format!("not a streaming op: {}", op.name()))),
    }
}

/// Copies the spans a list names (at most `entries`) into `dst`.
#[allow(clippy::too_many_arguments)]
fn copy(
    enc: &mut Encoder,
    list: &kestrel_cuda_rt::Buffer,
    host: &kestrel_cuda_rt::Buffer,
    cache: &kestrel_cuda_rt::Buffer,
    dst: &kestrel_cuda_rt::Buffer,
    entries: usize,
    blocks_per_span: u32,
    span: usize,
) -> Result<()> {
    let kern = enc.kernel(&MODULE, "expert_copy")?;
    enc.dispatch(&kern)
        .grid((blocks_per_span, u32_arg(entries)?))
        .block(COPY_THREADS)
        .read(list)
        .read(host)
        .read(cache)
        .write(dst)
        .arg((span / 16) as u64)
        .record();
    Ok(())
}
