//! Router and routed experts: `kernels/moe.cu`. Experts run as gate/up, down and an ordered
//! combine, through two per-node workspaces `[tokens * k, inter]` and `[tokens * k, hidden]`.

use kestrel_core::ir::{ExpertFormat, Op};
use kestrel_core::DType;

use super::{u32_arg, unsupported};
use crate::backend::Encoder;
use crate::error::Result;

const ROWS: usize = 8;

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match *op {
        Op::Router {
            logits,
            ids,
            weights,
            tokens,
            experts,
            k,
            normalize,
        } => {
            let kern = enc.device.kernel("moe", "router_f32")?;
            let (l, i, w) = (
                enc.buf(logits)?.clone(),
                enc.buf(ids)?.clone(),
                enc.buf(weights)?.clone(),
            );
            enc.list
                .dispatch(&kern)
                .grid(u32_arg(tokens)?)
                .block(128)
                .shared_mem(u32_arg(experts * 4)?)
                .read(&l)
                .write(&i)
                .write(&w)
                .arg(u32_arg(experts)?)
                .arg(u32_arg(k)?)
                .arg(normalize as i32)
                .record();
        }
        Op::MoeExperts {
            x,
            ids,
            weights,
            experts,
            layout,
            out,
            tokens,
            k,
        } => {
            let (name, group) = match layout.format {
                ExpertFormat::Bf16 => ("bf16", 0),
                ExpertFormat::Quant(q) if q.bits == 4 => ("q4", q.group_size),
                ExpertFormat::Quant(q) if q.bits == 8 => ("q8", q.group_size),
                ExpertFormat::Quant(q) => return Err(unsupported(format!("{}-bit experts", q.bits))),
            };
            let (h, i) = (layout.hidden, layout.inter);
            let act = enc.workspace(DType::F32, [tokens * k, i])?;
            let y = enc.workspace(DType::F32, [tokens * k, h])?;
            let (x, ids, w, e, o) = (
                enc.buf(x)?.clone(),
                enc.buf(ids)?.clone(),
                enc.buf(weights)?.clone(),
                enc.buf(experts)?.clone(),
                enc.buf(out)?.clone(),
            );
            let (g, u, d) = (layout.gate(), layout.up(), layout.down());
            let span = layout.span_bytes() as u64;
            let gate_up = enc.device.kernel("moe", &format!("moe_gate_up_{name}"))?;
            enc.list
                .dispatch(&gate_up)
                .grid((u32_arg(i.div_ceil(ROWS))?, u32_arg(tokens * k)?))
                .block(32 * ROWS as u32)
                .read(&x)
                .read(&ids)
                .read(&e)
                .write(&act)
                .arg(u32_arg(h)?)
                .arg(u32_arg(i)?)
                .arg(u32_arg(k)?)
                .arg(span)
                .arg(g.weight as u64)
                .arg(g.scales as u64)
                .arg(g.biases as u64)
                .arg(u.weight as u64)
                .arg(u.scales as u64)
                .arg(u.biases as u64)
                .arg(u32_arg(group)?)
                .record();
            let down = enc.device.kernel("moe", &format!("moe_down_{name}"))?;
            enc.list
                .dispatch(&down)
                .grid((u32_arg(h.div_ceil(ROWS))?, u32_arg(tokens * k)?))
                .block(32 * ROWS as u32)
                .read(&act)
                .read(&ids)
                .read(&e)
                .write(&y)
                .arg(u32_arg(h)?)
                .arg(u32_arg(i)?)
                .arg(span)
                .arg(d.weight as u64)
                .arg(d.scales as u64)
                .arg(d.biases as u64)
                .arg(u32_arg(group)?)
                .record();
            let combine = enc.device.kernel("moe", "moe_combine_f32")?;
            enc.list
                .dispatch(&combine)
                .grid((u32_arg(h.div_ceil(256))?, u32_arg(tokens)?))
                .block(256)
                .read(&y)
                .read(&w)
                .write(&o)
                .arg(u32_arg(h)?)
                .arg(u32_arg(k)?)
                .record();
        }
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}
