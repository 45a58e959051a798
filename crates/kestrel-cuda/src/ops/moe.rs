//! Router and routed experts: `kernels/moe.cu`, `kernels/skinny.cu` and `kernels/gemm.cu`. A few
//! tokens (quantised experts: fewer than `Config::skinny_experts_from`; bf16 experts: fewer than
//! `GROUPED_MIN_TOKENS`): gate/up per (token, slot) into
//! scratch activations `[tokens * k, inter]` (int8 for quantised experts), then down with the
//! weighted, ordered combine. More tokens: the slots sorted by expert on the device, each
//! expert's rows through skinny products while an expert gets a few rows on average (4- and
//! 8-bit experts; on Hopper their wgmma form from 4 to 32 rows), else through grouped
//! tensor-core GEMMs, then the same ordered combine.

use kestrel_core::expert_slots::{book_words, HEADER, USE};
use kestrel_core::ir::{Buf, ExpertFormat, LinearWeight, MatrixSpan, NormKind, Op};
use kestrel_core::quant::ScaleType;
use kestrel_core::DType;

use kestrel_cuda_rt::{Buffer, DispatchBuilder, ModuleSource, Result};

use super::common::{op_module, padded_len, quant_name, u32_arg, unsupported};
use super::elementwise::round_bf16;
use super::gemm::{self, mma_smem, GT_COLS, GT_K, GT_ROWS, GT_THREADS, SORT_MAX_EXPERTS, WG_SMEM};
use super::linear::weight_parts;
use super::skinny;
use crate::encoder::Encoder;

pub(crate) const MODULE: ModuleSource = op_module(
    "moe",
    include_str!("../../kernels/moe.cu"),
    &[
        ("ROUTE_BLOCKS", ROUTE_BLOCKS as i64),
        ("ROUTE_WARPS", ROUTE_WARPS as i64),
        ("ROUTE_NORM_VEC", ROUTE_NORM_VEC as i64),
        ("GU_WARPS", GU_WARPS as i64),
        ("GU_ROWS", GU_ROWS as i64),
        ("DOWN_WARPS", DOWN_WARPS as i64),
        ("GQ_WARPS", GQ_WARPS as i64),
        ("GQ_ROWS", GQ_ROWS as i64),
        ("SLOTS_HEADER", HEADER as i64),
        ("SLOTS_USE", USE as i64),
        ("RB_TOKENS", RB_TOKENS as i64),
        ("RB_EXPERTS", RB_EXPERTS as i64),
        ("RB_THREADS", RB_THREADS as i64),
        ("RB_K", RB_K as i64),
        ("RB_SPLITS", RB_SPLITS as i64),
        ("RC_WARPS", RC_WARPS as i64),
    ],
);

/// `moe_gate_up_bf16`: warps per block and rows of gate and of up per warp; `moe_down_*`: warps
/// per block, one output row each; the quantised `moe_gate_up_*`: warps per block and rows per
/// warp, together one int8 block of 32 activations.
const GU_WARPS: usize = 4;
const GU_ROWS: usize = 2;
const DOWN_WARPS: usize = 4;
const GQ_WARPS: usize = 16;
const GQ_ROWS: usize = 2;
/// `router_f32_*` holds up to 16 experts per lane of one warp, and slot j's weight in lane j.
const ROUTER_MAX_EXPERTS: usize = 512;
const ROUTER_MAX_K: usize = 32;

/// The bounded router's kernels (launched by `router.rs`): `router_bounds_*`'s tokens and experts
/// a block, its threads, the values of K a step and the most ranges K is split into; the warps of
/// a `router_choose_*` block, which takes a token.
pub(super) const RB_TOKENS: usize = 32;
pub(super) const RB_EXPERTS: usize = 64;
pub(super) const RB_THREADS: usize = 128;
pub(super) const RB_K: usize = 64;
pub(super) const RB_SPLITS: usize = 8;
pub(super) const RC_WARPS: usize = 4;

/// `route_*` (moe.cu): blocks of the cluster and warps per block.
const ROUTE_BLOCKS: usize = 8;
const ROUTE_WARPS: usize = 16;

/// From this many tokens on, experts run as grouped GEMMs (`gemm.cu`).
const GROUPED_MIN_TOKENS: usize = 16;
/// Whether `gemm.cu` handles these experts: dims in whole tiles, groups of whole 16-value
/// thread shares.
fn grouped_fits(layout: &kestrel_core::ir::ExpertLayout) -> bool {
    let group_ok = layout.formats().iter().all(|f| match f {
        ExpertFormat::Bf16 => true,
        ExpertFormat::Quant(q) => (q.bits == 4 || q.bits == 8) && q.group_size % 16 == 0,
    });
    group_ok && layout.hidden % GT_K == 0 && layout.inter % GT_K == 0 && layout.experts <= SORT_MAX_EXPERTS
}

/// How experts grouped by expert run: as `gemm.cu`'s tensor-core tiles of `GT_ROWS` rows, or as
/// `skinny.cu`'s products on row tiles of `8 * nt` (4- or 8-bit experts, gate and up of `bits`
/// bits, x laid out for them; gate/up writes the activations in the layout down reads for its own
/// bits).
#[derive(Clone, Copy)]
enum Grouped {
    Tiles,
    Skinny {
        nt: usize,
        bits: u32,
    },
    /// `skinny.cu`'s wgmma products on row tiles of `rows` (Hopper; `bits` as for `Skinny`).
    Wide {
        rows: usize,
        bits: u32,
    },
}

/// Each product's kernel-name part and group size (`bf16`, 0 for bf16 matrices): gate/up's,
/// then down's.
#[derive(Clone, Copy)]
struct ExpertNames {
    gate_up: (&'static str, usize),
    down: (&'static str, usize),
}

impl ExpertNames {
    fn of(layout: &kestrel_core::ir::ExpertLayout) -> Result<ExpertNames> {
        let one = |f: ExpertFormat| -> Result<(&'static str, usize)> {
            Ok(match f {
                ExpertFormat::Bf16 => ("bf16", 0),
                ExpertFormat::Quant(q) => (quant_name(&q)?, q.group_size),
            })
        };
        Ok(ExpertNames {
            gate_up: one(layout.format)?,
            down: one(layout.down)?,
        })
    }
}

/// One of a grouped layer's two products (gate/up, down): its kernel and module, the grid's x
/// (column blocks; y is the tile table), threads and shared memory of a block.
struct Launch {
    module: &'static ModuleSource,
    kernel: String,
    grid_x: usize,
    threads: u32,
    smem: usize,
}

/// Sort slots by expert, gate/up (SwiGLU, bf16 activations) and down (weighted, bf16 per slot)
/// over each expert's rows as `how` says, then the ordered f32 combine into `out`.
#[allow(clippy::too_many_arguments)]
fn encode_grouped(
    enc: &mut Encoder,
    x: &Buffer,
    ids: &Buffer,
    w: &Buffer,
    e: &Buffer,
    o: &Buffer,
    layout: &kestrel_core::ir::ExpertLayout,
    (tokens, k, names): (usize, usize, ExpertNames),
    how: Grouped,
) -> Result<()> {
    let (h, i) = (layout.hidden, layout.inter);
    let slots = tokens * k;
    let tile_rows = match how {
        Grouped::Tiles => GT_ROWS,
        Grouped::Skinny { nt, .. } => 8 * nt,
        Grouped::Wide { rows, .. } => rows,
    };
    let max_tiles = slots.div_ceil(tile_rows) + layout.experts;
    let xb = match how {
        Grouped::Tiles => round_bf16(enc, x, tokens, h)?,
        Grouped::Skinny { bits, .. } => skinny::permuted_x(enc, x, (tokens, h), bits, false)?,
        Grouped::Wide { bits, .. } => skinny::permuted_x(enc, x, (tokens, h), bits, true)?,
    };
    let (order, tiles, act, ys) = (
        enc.workspace(DType::U32, slots)?,
        enc.workspace(DType::U32, 3 * max_tiles)?,
        enc.workspace(DType::BF16, [slots, i])?,
        enc.workspace(DType::BF16, [slots, h])?,
    );
    let sort = enc.kernel(&gemm::MODULE, "moe_sort")?;
    enc.dispatch(&sort)
        .grid(1)
        .block(SORT_MAX_EXPERTS as u32)
        .read(ids)
        .write(&order)
        .write(&tiles)
        .arg(u32_arg(slots)?)
        .arg(u32_arg(layout.experts)?)
        .arg(u32_arg(max_tiles)?)
        .arg(u32_arg(tile_rows)?)
        .record();
    let span = layout.span_bytes() as u64;
    let (g, u, d) = (layout.gate(), layout.up(), layout.down_span());
    // The skinny and wide gate/up write the activations in the layout of down's bits.
    let gate_up_act = match layout.formats() {
        [ExpertFormat::Quant(q), ExpertFormat::Quant(qd)] if q.bits != qd.bits => {
            format!("{}_act{}", names.gate_up.0, qd.bits)
        }
        _ => names.gate_up.0.to_string(),
    };
    // The skinny and wide kernels' modules, by each matrix's format.
    let quant = match layout.formats() {
        [ExpertFormat::Quant(q), ExpertFormat::Quant(qd)] => Some((q, qd)),
        _ => None,
    };
    let modules = |wide: bool| -> Result<(&'static ModuleSource, &'static ModuleSource)> {
        let (q, qd) = quant.ok_or_else(|| unsupported("skinny products of bf16 experts".to_string()))?;
        Ok((skinny::expert_module(&q, wide), skinny::expert_module(&qd, wide)))
    };
    let (gate_up, down) = match how {
        Grouped::Tiles => {
            // Hopper: both products on wgmma tiles of 128 columns (down where hidden divides).
            let wg = enc.device.wgmma();
            let tiles = |kernel: String, grid_x, smem| Launch {
                module: &gemm::MODULE,
                kernel,
                grid_x,
                threads: GT_THREADS,
                smem,
            };
            let gate_up = match wg {
                true => tiles(
                    format!("moe_gemm_gate_up_{}_wg", names.gate_up.0),
                    i / GT_COLS,
                    WG_SMEM,
                ),
                false => tiles(
                    format!("moe_gemm_gate_up_{}", names.gate_up.0),
                    i / GT_COLS,
                    mma_smem(2),
                ),
            };
            // 128 output columns a block where hidden allows.
            let nb = if h % (2 * GT_COLS) == 0 { 2 } else { 1 };
            let down = match (wg, nb) {
                (true, 2) => tiles(
                    format!("moe_gemm_down_{}_wg", names.down.0),
                    h / (2 * GT_COLS),
                    WG_SMEM,
                ),
                _ => tiles(
                    format!("moe_gemm_down_{}_{nb}", names.down.0),
                    h / (nb * GT_COLS),
                    mma_smem(nb),
                ),
            };
            (gate_up, down)
        }
        Grouped::Skinny { nt, .. } => {
            // The tiles that hold rows: at most one per expert or per slot (for the split of K).
            let used = slots.min(layout.experts);
            let (gate_up_module, down_module) = modules(false)?;
            // gate/up reads its tile's rows of x from shared memory where they are staged.
            let as_launch = |module, (kernel, grid_x), smem| Launch {
                module,
                kernel,
                grid_x,
                threads: skinny::THREADS,
                smem,
            };
            let gate_up = as_launch(
                gate_up_module,
                skinny::launch(enc, "moe_skinny_gate_up", &gate_up_act, nt, i, used),
                skinny::staged_smem(nt, h),
            );
            let down = as_launch(
                down_module,
                skinny::launch(enc, "moe_skinny_down", names.down.0, nt, h, used),
                0,
            );
            (gate_up, down)
        }
        Grouped::Wide { rows, .. } => {
            // gate and up on a warpgroup each, down on one.
            let (gate_up_module, down_module) = modules(true)?;
            let wide = |module, kernel: &str, name: &str, features: usize, warpgroups: u32| Launch {
                module,
                kernel: format!("{kernel}_{name}_{rows}"),
                grid_x: features / 64,
                threads: 128 * warpgroups,
                smem: skinny::wide_smem(rows),
            };
            (
                wide(gate_up_module, "moe_wide_gate_up", &gate_up_act, i, 2),
                wide(down_module, "moe_wide_down", names.down.0, h, 1),
            )
        }
    };
    let kern = enc.kernel(gate_up.module, &gate_up.kernel)?;
    let b = enc
        .dispatch(&kern)
        .grid((u32_arg(gate_up.grid_x)?, u32_arg(max_tiles)?))
        .block(gate_up.threads)
        .shared_mem(u32_arg(gate_up.smem)?)
        .read(&xb)
        .read(&order)
        .read(&tiles)
        .read(e)
        .write(&act);
    expert_args(b, (h, i, k), span, &[g, u], names.gate_up.1)?.record();
    let kern = enc.kernel(down.module, &down.kernel)?;
    enc.dispatch(&kern)
        .grid((u32_arg(down.grid_x)?, u32_arg(max_tiles)?))
        .block(down.threads)
        .shared_mem(u32_arg(down.smem)?)
        .read(&act)
        .read(&order)
        .read(&tiles)
        .read(w)
        .read(e)
        .write(&ys)
        .arg(u32_arg(h)?)
        .arg(u32_arg(i)?)
        .arg(span)
        .arg(d.weight as u64)
        .arg(d.scales as u64)
        .arg(d.biases as u64)
        .arg(u32_arg(names.down.1)?)
        .record();
    let combine = enc.kernel(&gemm::MODULE, "moe_combine")?;
    enc.dispatch(&combine)
        .cover(tokens * h / 8, 256)
        .read(&ys)
        .read(ids)
        .write(o)
        .arg(u32_arg(tokens)?)
        .arg(u32_arg(h)?)
        .arg(u32_arg(k)?)
        .arg(u32_arg(layout.experts)?)
        .record();
    Ok(())
}

/// Bytes of shared memory for `n` values staged as int8 with their scales and sums.
fn int8_smem(n: usize) -> usize {
    n + (n / 32 + n / 16) * 4
}

/// The trailing arguments every expert kernel takes: dims, span, the byte offsets of its matrices
/// (weight, scales, biases each) and the group size.
fn expert_args<'a>(
    b: DispatchBuilder<'a>,
    (h, i, k): (usize, usize, usize),
    span: u64,
    mats: &[MatrixSpan],
    group: usize,
) -> Result<DispatchBuilder<'a>> {
    let mut b = b.arg(u32_arg(h)?).arg(u32_arg(i)?).arg(u32_arg(k)?).arg(span);
    for m in mats {
        b = b.arg(m.weight as u64).arg(m.scales as u64).arg(m.biases as u64);
    }
    Ok(b.arg(u32_arg(group)?))
}

/// `router_f32_*` / `route_*`: experts per lane for this many experts.
pub(super) fn router_per_lane(experts: usize) -> usize {
    [4, 8, 16]
        .into_iter()
        .find(|&n| experts <= 32 * n)
        .expect("experts checked against ROUTER_MAX_EXPERTS")
}

/// `route_norm_*`: float4s of the normalised row a thread holds (`ROUTE_NORM_VEC` in moe.cu).
const ROUTE_NORM_VEC: usize = 4;

/// The most tokens `route_*` takes, a cluster each (a batched step of a few sequences; more
/// tokens' logits come from `matvec_*_exact_tokens_*`, several tokens a block). The norm in front
/// of them is kept live through the product (`Op::may_join`), which the kernel needs.
const ROUTE_MAX_TOKENS: usize = kestrel_core::ir::JOIN_MAX_TOKENS;

/// The residual add and norm `route_norm_*` can do in front of a router's product: an
/// `AddRmsNorm` of the product's `tokens` rows writing f32 into its input, with f32 or bf16
/// weights and rows of whole, 16-byte aligned float4s that fit the kernel's registers.
struct FusedNorm {
    residual: Buffer,
    add: Buffer,
    w: Buffer,
    out: Buffer,
    eps: f32,
    zero_centered: bool,
    w_bf16: bool,
}

fn fused_norm(
    norm: &Op,
    x: kestrel_core::ir::Buf,
    (tokens, in_dim): (usize, usize),
    enc: &Encoder,
) -> Result<Option<FusedNorm>> {
    let &Op::AddRmsNorm {
        residual,
        x: add,
        w,
        out,
        dim,
        eps,
        kind,
    } = norm
    else {
        return Ok(None);
    };
    let w_bf16 = match enc.dtype(w) {
        DType::BF16 => true,
        DType::F32 => false,
        _ => return Ok(None),
    };
    if out != x
        || dim != in_dim
        || enc.graph.decl(add).elem_count() != tokens * dim
        || dim % 4 != 0
        || dim / 4 > ROUTE_NORM_VEC * 32 * ROUTE_WARPS
        || [residual, add, out].iter().any(|&b| enc.dtype(b) != DType::F32)
    {
        return Ok(None);
    }
    let n = FusedNorm {
        residual: enc.buf(residual)?.clone(),
        add: enc.buf(add)?.clone(),
        w: enc.buf(w)?.clone(),
        out: enc.buf(out)?.clone(),
        eps,
        zero_centered: kind == NormKind::ZeroCentered,
        w_bf16,
    };
    let aligned = [&n.residual, &n.add, &n.w, &n.out]
        .iter()
        .all(|b| b.device_ptr() % 16 == 0);
    Ok(aligned.then_some(n))
}

/// A streamed layer's one-token fetch, resolved by the router's kernel.
struct RouteFetch {
    table: Buffer,
    src: Buffer,
    out: Buffer,
    slots: usize,
    half_life: u32,
}

/// A router's product and the choice that reads its logits, as the fused encoders take them.
pub(super) struct RouterPair<'a> {
    pub x: Buf,
    pub w: &'a LinearWeight,
    pub logits: Buf,
    pub ids: Buf,
    pub weights: Buf,
    pub tokens: usize,
    pub in_dim: usize,
    pub experts: usize,
    pub k: usize,
    pub normalize: bool,
}

impl<'a> RouterPair<'a> {
    /// `linear` and `router` when the router chooses, for the product's tokens, from the logits
    /// the product writes (one per output), within `router_f32_*`'s limits.
    pub(super) fn of(linear: &'a Op, router: &Op) -> Option<Self> {
        let (
            &Op::Linear {
                x,
                ref w,
                out,
                tokens,
                in_dim,
                out_dim,
            },
            &Op::Router {
                logits,
                ids,
                weights,
                tokens: router_tokens,
                experts,
                k,
                normalize,
            },
        ) = (linear, router)
        else {
            return None;
        };
        let fits = logits == out
            && tokens == router_tokens
            && experts == out_dim
            && experts <= ROUTER_MAX_EXPERTS
            && k <= ROUTER_MAX_K;
        fits.then_some(RouterPair {
            x,
            w,
            logits,
            ids,
            weights,
            tokens,
            in_dim,
            experts,
            k,
            normalize,
        })
    }
}

/// A router's product (`linear`, writing the logits) and its choice (`router`) for up to
/// `ROUTE_MAX_TOKENS` tokens as one `route_*` kernel, on a cluster of blocks a token (sm_90),
/// which also writes the logits. The product is computed as the exact one-token matvec computes
/// it. With `norm`, the residual add and norm that write the product's input go in front
/// (`route_norm_*`) when they fit (`fused_norm`). With `fetch`, a streamed layer's `ExpertFetch` of the chosen experts, and
/// `experts_op`, the `MoeExperts` that reads the slots it gives them, the kernel also resolves
/// the choice into the layer's slots and the experts' `*_streamed` kernels read the misses from
/// host memory, writing them into their slots as they go (one token). Returns false, recording
/// nothing, for any other pair, weight format or device, a norm or books that do not fit, or a
/// fetch without experts that read its slots.
pub fn encode_route(
    norm: Option<&Op>,
    linear: &Op,
    router: &Op,
    fetch: Option<&Op>,
    experts_op: Option<&Op>,
    enc: &mut Encoder,
) -> Result<bool> {
    let Some(RouterPair {
        x,
        w,
        logits,
        ids,
        weights,
        tokens,
        in_dim,
        experts,
        k,
        normalize,
    }) = RouterPair::of(linear, router)
    else {
        return Ok(false);
    };
    if !(1..=ROUTE_MAX_TOKENS).contains(&tokens)
        || (fetch.is_some() && tokens != 1)
        || enc.device.info().compute_capability.0 < 9
    {
        return Ok(false);
    }
    let fused = match norm {
        Some(op) => match fused_norm(op, x, (tokens, in_dim), enc)? {
            Some(n) => Some(n),
            None => return Ok(false),
        },
        // The kernel reads x as float4s.
        None if enc.buf(x)?.device_ptr() % 16 != 0 => return Ok(false),
        None => None,
    };
    // Staged x: padded floats; for quantised weights then the plain sum of x over each 16-byte
    // vector's values; with the norm in front, that part rounded up to 4 floats, then the
    // normalised row and the residual's new values.
    let vals = match w {
        // The route kernels read bf16 group scales (MLX's routers); f32 ones take the unfused path.
        LinearWeight::Quant { format, .. }
            if (format.bits == 4 || format.bits == 8) && format.scale == ScaleType::Bf16 =>
        {
            let vals = 128 / format.bits as usize;
            if format.group_size % vals != 0 || in_dim % vals != 0 {
                return Ok(false);
            }
            vals
        }
        LinearWeight::Dense(d) if enc.dtype(d.raw()) == DType::BF16 && in_dim % 8 == 0 => 8,
        LinearWeight::Dense(d) if enc.dtype(d.raw()) == DType::F32 && in_dim % 4 == 0 => 4,
        _ => return Ok(false),
    };
    let quantised = matches!(w, LinearWeight::Quant { .. });
    let staged = padded_len(in_dim) * 4;
    let smem = match (&fused, quantised) {
        (Some(_), _) => staged + (in_dim / vals).next_multiple_of(4) * 4 + 2 * in_dim * 4,
        (None, true) => staged + in_dim / vals * 4,
        (None, false) => staged,
    };
    let (name, bufs, group) = weight_parts(enc, w)?;
    // A streamed layer's books go after the rest, in block 0's shared memory.
    let books_at = smem.div_ceil(4);
    // A streamed layer's fetch, and the experts that read the slots it gives.
    let stream = match (fetch, experts_op) {
        (None, None) => None,
        (
            Some(&Op::ExpertFetch {
                ids: fetched,
                table,
                src,
                cache,
                out,
                tokens: 1,
                k: fk,
                experts: fe,
                slots,
                span,
                policy,
            }),
            Some(
                op @ &Op::MoeExperts {
                    ids: read,
                    experts: cached,
                    tokens: 1,
                    k: ek,
                    layout,
                    ..
                },
            ),
        ) if fetched == ids
            && (fk, ek, fe) == (k, k, experts)
            && (k..=super::stream::MAX_SLOTS).contains(&slots)
            && (read, cached) == (out, cache)
            && (layout.experts, layout.span_bytes()) == (slots, span) =>
        {
            let f = RouteFetch {
                table: enc.buf(table)?.clone(),
                src: enc.buf(src)?.clone(),
                out: enc.buf(out)?.clone(),
                slots,
                half_life: policy.half_life(),
            };
            Some((f, op))
        }
        _ => return Ok(false),
    };
    let smem = match &stream {
        Some((f, _)) => (books_at + book_words(f.slots, experts)) * 4,
        None => smem,
    };
    if smem > enc.device.info().max_shared_per_block {
        return Ok(false);
    }
    // Which chosen experts missed, for the `*_streamed` expert kernels.
    let stream = match stream {
        Some((f, op)) => Some((f, op, enc.workspace(DType::U32, k)?)),
        None => None,
    };
    let prefix = if fused.is_some() { "route_norm" } else { "route" };
    // A streamed layer's fetch takes the twin that resolves it.
    let suffix = if stream.is_some() { "_slots" } else { "" };
    let kern = enc.kernel(
        &MODULE,
        &format!("{prefix}_{name}_{}{suffix}", router_per_lane(experts)),
    )?;
    let (l, i, wt) = (
        enc.buf(logits)?.clone(),
        enc.buf(ids)?.clone(),
        enc.buf(weights)?.clone(),
    );
    let x = enc.buf(x)?.clone();
    let mut b = enc
        .dispatch(&kern)
        .grid((u32_arg(ROUTE_BLOCKS)?, u32_arg(tokens)?))
        .block(u32_arg(32 * ROUTE_WARPS)?)
        .shared_mem(u32_arg(smem)?);
    b = match &fused {
        Some(n) => b.read_write(&n.residual).read(&n.add).read(&n.w).write(&n.out),
        None => b.read(&x),
    };
    for buf in &bufs {
        b = b.read(buf);
    }
    b = b
        .write(&l)
        .write(&i)
        .write(&wt)
        .arg(u32_arg(in_dim)?)
        .arg(u32_arg(experts)?);
    if let Some(g) = group {
        b = b.arg(u32_arg(g)?);
    }
    b = b.arg(u32_arg(k)?).arg(normalize as i32);
    if let Some(n) = &fused {
        b = b.arg(n.eps).arg(n.zero_centered as i32).arg(n.w_bf16 as i32);
    }
    let Some((f, experts_op, miss)) = stream else {
        b.record();
        return Ok(true);
    };
    b.read_write(&f.table)
        .arg(u32_arg(books_at)?)
        .arg(u32_arg(f.slots)?)
        .arg(f.half_life)
        .write(&f.out)
        .write(&miss)
        .record();
    encode_experts(experts_op, enc, Some((&f.src, &miss)))?;
    Ok(true)
}

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
            if experts > ROUTER_MAX_EXPERTS || k > ROUTER_MAX_K {
                return Err(unsupported(format!("top-{k} of {experts} experts")));
            }
            let per_lane = router_per_lane(experts);
            let kern = enc.kernel(&MODULE, &format!("router_f32_{per_lane}"))?;
            let (l, i, w) = (
                enc.buf(logits)?.clone(),
                enc.buf(ids)?.clone(),
                enc.buf(weights)?.clone(),
            );
            enc.dispatch(&kern)
                .grid(u32_arg(tokens)?)
                .block(32)
                .read(&l)
                .write(&i)
                .write(&w)
                .arg(u32_arg(experts)?)
                .arg(u32_arg(k)?)
                .arg(normalize as i32)
                .record();
        }
        Op::MoeExperts { .. } => encode_experts(op, enc, None)?,
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}

/// A `MoeExperts` op. With `stream` (the host's packed experts and the misses `route_*_slots`
/// wrote), a streamed layer's one-token step whose `experts` are the layer's cache: the
/// `*_streamed` kernels read each miss from host memory and write it into its slot.
fn encode_experts(op: &Op, enc: &mut Encoder, stream: Option<(&Buffer, &Buffer)>) -> Result<()> {
    match *op {
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
            let names = ExpertNames::of(&layout)?;
            let bf16 = layout.formats() == [ExpertFormat::Bf16; 2];
            let quantised = !layout.formats().contains(&ExpertFormat::Bf16);
            if !bf16 && !quantised {
                return Err(unsupported(
                    "experts with bf16 and quantised matrices together".to_string(),
                ));
            }
            let (x, ids, w, e, o) = (
                enc.buf(x)?.clone(),
                enc.buf(ids)?.clone(),
                enc.buf(weights)?.clone(),
                enc.buf(experts)?.clone(),
                enc.buf(out)?.clone(),
            );
            // bf16 experts keep f32 activations when their rounding is switched off
            // (`Exact::experts`); quantised ones have no f32 kernel.
            let exact = enc.exact.experts && bf16;
            // Skinny products for a few rows an expert, from `skinny_experts_from` tokens on
            // (gate/up writes the activations in the layout of down's bits, `_act*` where they
            // differ). On Hopper, the wgmma form of them up to a few dozen rows an expert. Below
            // that, one token's kernels: they need no sort, permutation or combine, and read a
            // few tokens' experts in about the time of one's.
            let skinny = match layout.formats() {
                [ExpertFormat::Quant(q), ExpertFormat::Quant(_)]
                    if tokens >= enc.device.skinny_experts_from().max(2)
                        && skinny::moe_fits(&layout, &e, &x) =>
                {
                    let wide = skinny::moe_wide_fits(enc, &layout, &e, &x)
                        .then(|| skinny::moe_wide_rows(tokens * k, layout.experts))
                        .flatten();
                    match wide {
                        Some(rows) => Some(Grouped::Wide { rows, bits: q.bits }),
                        // gate/up's activations staged in shared memory must fit it.
                        None => skinny::moe_row_tiles(tokens * k, layout.experts)
                            .filter(|&nt| {
                                skinny::staged_smem(nt, layout.hidden)
                                    <= enc.device.info().max_shared_per_block
                            })
                            .map(|nt| Grouped::Skinny { nt, bits: q.bits }),
                    }
                }
                _ => None,
            };
            let args = (tokens, k, names);
            let sortable = stream.is_none() && layout.experts <= SORT_MAX_EXPERTS;
            if let (Some(how), true) = (skinny, sortable) {
                encode_grouped(enc, &x, &ids, &w, &e, &o, &layout, args, how)?;
            } else if stream.is_none() && tokens >= GROUPED_MIN_TOKENS && grouped_fits(&layout) && !exact {
                encode_grouped(enc, &x, &ids, &w, &e, &o, &layout, args, Grouped::Tiles)?;
            } else if bf16 {
                encode_bf16(enc, &x, &ids, &w, &e, &o, &layout, (tokens, k), stream)?;
            } else {
                encode_int8(enc, &x, &ids, &w, &e, &o, &layout, args, stream)?;
            }
        }
        _ => unreachable!("encode_experts takes MoeExperts"),
    }
    Ok(())
}

/// Few tokens, quantised experts: gate/up rounds each token's x to int8 in every block and writes
/// the activations as int8 (a block of 32 per block of the grid); down reads them as they are.
#[allow(clippy::too_many_arguments)]
fn encode_int8(
    enc: &mut Encoder,
    x: &Buffer,
    ids: &Buffer,
    w: &Buffer,
    e: &Buffer,
    o: &Buffer,
    layout: &kestrel_core::ir::ExpertLayout,
    (tokens, k, names): (usize, usize, ExpertNames),
    stream: Option<(&Buffer, &Buffer)>,
) -> Result<()> {
    let (h, i) = (layout.hidden, layout.inter);
    let [ExpertFormat::Quant(q), ExpertFormat::Quant(qd)] = layout.formats() else {
        unreachable!("encode_int8 takes quantised experts")
    };
    // A 16-byte weight vector (32 4-bit or 16 8-bit values) takes one group's scale and bias.
    for f in [q, qd] {
        let vals = 128 / f.bits as usize;
        if h % 32 != 0 || i % 32 != 0 || f.group_size % vals != 0 {
            return Err(unsupported(format!(
                "quantised expert dims {h}x{i} are not multiples of 32, or groups of {} not of {vals}",
                f.group_size
            )));
        }
    }
    let (name, group) = names.gate_up;
    let max_smem = enc.device.info().max_shared_per_block;
    // gate/up: 32 activations, each warp's rows' group scales and biases (GQ_WARPS x 2 GQ_ROWS
    // rows x 2 values per group, of the format's scale type; factored ones as f32), then x as int8;
    // factored scales then copied as stored (16-byte aligned: units, then multiples).
    let (staged, raw) = match q.scale {
        ScaleType::Factored => (4, 16 + GQ_WARPS * 2 * GQ_ROWS * (8 * (h / 256) + 2 * (h / group))),
        s => (s.size_in_bytes(), 0),
    };
    let gu_smem = 32 * 4 + GQ_WARPS * 2 * GQ_ROWS * 2 * staged * (h / group) + int8_smem(h) + raw;
    if gu_smem > max_smem || k * int8_smem(i) > max_smem {
        return Err(unsupported(format!(
            "top-{k} experts of {h}x{i} exceed shared memory"
        )));
    }
    let n = tokens * k * i;
    let (aq, ad, as16) = (
        enc.workspace(DType::I32, n / 4)?,
        enc.workspace(DType::F32, n / 32)?,
        enc.workspace(DType::F32, n / 16)?,
    );
    let (g, u, d) = (layout.gate(), layout.up(), layout.down_span());
    let span = layout.span_bytes() as u64;
    let suffix = if stream.is_some() { "_streamed" } else { "" };
    // gate/up writes the activations in the order down's bits read them.
    let act = match q.bits == qd.bits {
        true => String::new(),
        false => format!("_act{}", qd.bits),
    };
    let gate_up = enc.kernel(&MODULE, &format!("moe_gate_up_{name}{act}{suffix}"))?;
    let down = enc.kernel(&MODULE, &format!("moe_down_{}{suffix}", names.down.0))?;
    let b = enc
        .dispatch(&gate_up)
        .grid((u32_arg(i / (GQ_WARPS * GQ_ROWS))?, u32_arg(tokens * k)?))
        .block(u32_arg(32 * GQ_WARPS)?)
        .shared_mem(u32_arg(gu_smem)?)
        .read(x)
        .read(ids);
    let b = experts_arg(b, e, stream).write(&aq).write(&ad).write(&as16);
    stream_args(expert_args(b, (h, i, k), span, &[g, u], group)?, stream).record();
    let b = enc
        .dispatch(&down)
        .grid((u32_arg(h.div_ceil(DOWN_WARPS))?, u32_arg(tokens)?))
        .block(u32_arg(32 * DOWN_WARPS)?)
        .shared_mem(u32_arg(k * int8_smem(i))?)
        .read(&aq)
        .read(&ad)
        .read(&as16)
        .read(ids)
        .read(w);
    let b = experts_arg(b, e, stream).write(o);
    stream_args(expert_args(b, (h, i, k), span, &[d], names.down.1)?, stream).record();
    Ok(())
}

/// The experts' buffer of a few-token expert kernel: read, or also written when a streamed
/// step's kernels write its misses into their slots.
fn experts_arg<'a>(
    b: DispatchBuilder<'a>,
    e: &Buffer,
    stream: Option<(&Buffer, &Buffer)>,
) -> DispatchBuilder<'a> {
    match stream {
        Some(_) => b.read_write(e),
        None => b.read(e),
    }
}

/// The `*_streamed` expert kernels' last arguments: the host's packed experts and the misses.
fn stream_args<'a>(b: DispatchBuilder<'a>, stream: Option<(&Buffer, &Buffer)>) -> DispatchBuilder<'a> {
    match stream {
        Some((host, miss)) => b.read(host).read(miss),
        None => b,
    }
}

/// Few tokens, bf16 experts: gate/up per (token, slot) into f32 activations `[tokens * k, inter]`,
/// then down with the weighted, ordered combine; x and the activations staged as floats.
#[allow(clippy::too_many_arguments)]
fn encode_bf16(
    enc: &mut Encoder,
    x: &Buffer,
    ids: &Buffer,
    w: &Buffer,
    e: &Buffer,
    o: &Buffer,
    layout: &kestrel_core::ir::ExpertLayout,
    (tokens, k): (usize, usize),
    stream: Option<(&Buffer, &Buffer)>,
) -> Result<()> {
    let (h, i) = (layout.hidden, layout.inter);
    if h % 8 != 0 || i % 8 != 0 {
        return Err(unsupported(format!("expert dims {h}x{i} are not multiples of 8")));
    }
    if (k * padded_len(i)).max(padded_len(h)) * 4 > enc.device.info().max_shared_per_block {
        return Err(unsupported(format!(
            "top-{k} experts of width {i} exceed shared memory"
        )));
    }
    let act = enc.workspace(DType::F32, [tokens * k, i])?;
    let (g, u, d) = (layout.gate(), layout.up(), layout.down_span());
    let span = layout.span_bytes() as u64;
    let suffix = if stream.is_some() { "_streamed" } else { "" };
    let gate_up = enc.kernel(&MODULE, &format!("moe_gate_up_bf16{suffix}"))?;
    let down = enc.kernel(&MODULE, &format!("moe_down_bf16{suffix}"))?;
    let b = enc
        .dispatch(&gate_up)
        .grid((u32_arg(i.div_ceil(GU_WARPS * GU_ROWS))?, u32_arg(tokens * k)?))
        .block(u32_arg(32 * GU_WARPS)?)
        .shared_mem(u32_arg(padded_len(h) * 4)?)
        .read(x)
        .read(ids);
    let b = experts_arg(b, e, stream).write(&act);
    stream_args(expert_args(b, (h, i, k), span, &[g, u], 0)?, stream).record();
    let b = enc
        .dispatch(&down)
        .grid((u32_arg(h.div_ceil(DOWN_WARPS))?, u32_arg(tokens)?))
        .block(u32_arg(32 * DOWN_WARPS)?)
        .shared_mem(u32_arg(k * padded_len(i) * 4)?)
        .read(&act)
        .read(ids)
        .read(w);
    let b = experts_arg(b, e, stream).write(o);
    stream_args(expert_args(b, (h, i, k), span, &[d], 0)?, stream).record();
    Ok(())
}
