//! KV-cache append (alone or with the per-head norms and rotation of q and k) and causal GQA
//! attention: `kernels/attention.cu`.

use kestrel_core::ir::{Buf, KvPages, NormKind, Op, QueryChunk};
use kestrel_core::DType;

use super::common::{float_name, op_module, u32_arg, unsupported};
use super::linear;
use kestrel_cuda_rt::{Buffer, DispatchBuilder, Kernel, ModuleSource, Result};

use crate::encoder::Encoder;

pub(crate) const MODULE: ModuleSource = op_module(
    "attention",
    include_str!("../../kernels/attention.cu"),
    &[
        ("WARPS", WARPS as i64),
        ("MAX_PER_LANE", MAX_PER_LANE as i64),
        ("GROUP", GROUP as i64),
        ("DEC_WARPS", DEC_WARPS as i64),
        ("MAX_SPLITS", MAX_SPLITS as i64),
        ("COMBINE_THREADS", COMBINE_THREADS as i64),
        ("COMBINE_WARPS", COMBINE_WARPS as i64),
        ("COMBINE_LOADS", COMBINE_LOADS as i64),
        ("FA_WARPS", FA_WARPS as i64),
        ("FA_KEYS", FA_KEYS as i64),
        ("FA_KEYS_WIDE", FA_KEYS_WIDE as i64),
        ("WIDE_HEAD_DIM", WIDE_HEAD_DIM as i64),
        ("DA_ROWS", DA_ROWS as i64),
        ("DA_KEYS", DA_KEYS as i64),
        ("DA_STAGES", DA_STAGES as i64),
        ("DA_WARPS", DA_WARPS as i64),
        ("DA_WARPS_WIDE", DA_WARPS_WIDE as i64),
        ("AI_WARPS", AI_WARPS as i64),
        ("AI_ROW_WARPS", AI_ROW_WARPS as i64),
        ("AI_ROW_BATCH", AI_ROW_BATCH as i64),
    ],
);

/// `attention_*` (the plain kernel): warps per block, and dims a lane holds (so head dims up to
/// 32 of them).
const WARPS: usize = 4;
const MAX_PER_LANE: usize = 8;
const MAX_HEAD_DIM: usize = 32 * MAX_PER_LANE;
/// Head dims over this take the wide-head shapes of `flash_attention_*` and
/// `decode_attention_*`.
const WIDE_HEAD_DIM: usize = 128;

/// `attention_inputs_warps_*`: heads a block takes, a warp each, from `AI_WARPS_MIN_TOKENS`
/// tokens (a 512-token prefill's 20,480 blocks of one head each took 29 µs a layer on the H200,
/// 18 µs so; a decode token's 40 heads lost 2% of tg128 so, against a block a head; batched
/// decode of 32 to 256 tokens was within 0.5% either way, from 16 tokens or from 128).
const AI_WARPS: usize = 4;
const AI_WARPS_MIN_TOKENS: usize = 128;
/// `attention_inputs_rows_*`, which takes those many tokens where the head dim is one of
/// `AI_ROW_HEAD_DIMS` and the rotated half a power-of-two multiple of 32 (or none is rotated):
/// blocks of `AI_ROW_WARPS` warps, each loading `AI_ROW_BATCH` heads of a token at once.
const AI_ROW_WARPS: usize = 4;
const AI_ROW_BATCH: usize = 4;
const AI_ROW_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Whether `attention_inputs_rows_*` takes inputs of `head_dim` values a head, `rot_dim` of them
/// rotated.
fn inputs_by_rows(head_dim: usize, rot_dim: usize) -> bool {
    let half32 = rot_dim / 2 / 32;
    AI_ROW_HEAD_DIMS.contains(&head_dim)
        && rot_dim <= head_dim
        && rot_dim % 64 == 0
        && (rot_dim == 0 || half32.is_power_of_two())
}

/// f32 caches: decode-sized batches take the split-over-context path.
const SPLIT_MAX_TOKENS: usize = 4;
/// `attention_split_*`: query heads per block, warps per block, and keys per warp batch.
const GROUP: usize = 8;
const DEC_WARPS: usize = 4;
/// The most splits of a cache range (`attention_combine_many_f32` keeps a weight per split in
/// shared memory) and its block size; rows (one warp each) per block of `attention_combine_f32`
/// and the most splits it takes (the splits a lane loads at once).
const MAX_SPLITS: usize = 1024;
const COMBINE_THREADS: usize = 256;
const COMBINE_WARPS: usize = 4;
const COMBINE_LOADS: usize = 8;
/// `flash_attention_*`: head dims it is built for, warps per block, and keys per tile for
/// narrow and wide heads (its `FaShape::BN`).
const FLASH_HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];
const FA_WARPS: usize = 4;
const FA_KEYS: usize = 64;
const FA_KEYS_WIDE: usize = 32;
/// The most row blocks `flash_attention_*` ranks by their causal ranges (several runs' rows,
/// a word of shared memory each); more start in the order of their rows.
const FA_RANKED: usize = 1024;

/// The element type of a K and a V cache, which must agree.
fn cache_dtype(enc: &Encoder, k_cache: Buf, v_cache: Buf) -> Result<DType> {
    let cache = enc.dtype(k_cache);
    if enc.dtype(v_cache) != cache {
        return Err(unsupported("k and v caches of different dtypes".into()));
    }
    Ok(cache)
}

/// The block table and sequence ids of `KvPages`, resolved, with the shape its kernels take.
struct Pages {
    table: Buffer,
    seq: Buffer,
    pages: KvPages,
}

impl Pages {
    fn new(enc: &Encoder, pages: KvPages) -> Result<Self> {
        if !pages.block.is_power_of_two() {
            return Err(unsupported(format!("blocks of {} rows", pages.block)));
        }
        Ok(Pages {
            table: enc.buf(pages.table)?.clone(),
            seq: enc.buf(pages.seq)?.clone(),
            pages,
        })
    }

    /// The kernels' page arguments: table, seq, seq_step, max_blocks, shift.
    fn args<'e>(&self, b: DispatchBuilder<'e>) -> Result<DispatchBuilder<'e>> {
        Ok(b.read(&self.table)
            .read(&self.seq)
            .arg(u32::from(!self.pages.one_seq))
            .arg(u32_arg(self.pages.max_blocks)?)
            .arg(self.pages.block.trailing_zeros()))
    }
}

/// An `Op::Attention` as its encoders use it: the buffers resolved, the cache's dtype (k and v
/// caches alike, checked here), and the shape.
struct Attn {
    q: Buffer,
    kc: Buffer,
    vc: Buffer,
    positions: Buffer,
    pages: Pages,
    out: Buffer,
    cache: DType,
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Rows of the caches.
    rows: usize,
    /// Positions a sequence holds (the range the kernels split).
    max_ctx: usize,
    scale: f32,
    /// Queries from a token on attend to its run's sequence (see `Op::Attention`).
    chunk: Option<QueryChunk>,
    /// A batched step's positions and sequences, of all its tokens (those of `Attn::rows`
    /// included), and their number: where a sequence's rows written by this step begin.
    step: Option<(Buffer, Buffer, usize)>,
}

impl Attn {
    /// A dispatch of `kern` with the arguments every attention kernel starts with: q, the two
    /// caches, the positions and the pages.
    fn dispatch<'e>(&self, enc: &'e mut Encoder, kern: &Kernel) -> Result<DispatchBuilder<'e>> {
        let b = enc
            .dispatch(kern)
            .read(&self.q)
            .read(&self.kc)
            .read(&self.vc)
            .read(&self.positions);
        self.pages.args(b)
    }

    fn new(enc: &Encoder, op: &Op) -> Result<Self> {
        let Op::Attention {
            q,
            k_cache,
            v_cache,
            positions,
            pages,
            out,
            tokens,
            heads,
            kv_heads,
            head_dim,
            rows,
            scale,
            chunk,
        } = *op
        else {
            unreachable!("called for attention")
        };
        let cache = cache_dtype(enc, k_cache, v_cache)?;
        let max_ctx = pages.max_ctx();
        let pages = Pages::new(enc, pages)?;
        let positions = enc.buf(positions)?.clone();
        let step = (!pages.pages.one_seq).then(|| (positions.clone(), pages.seq.clone(), tokens));
        Ok(Attn {
            q: enc.buf(q)?.clone(),
            kc: enc.buf(k_cache)?.clone(),
            vc: enc.buf(v_cache)?.clone(),
            positions,
            pages,
            out: enc.buf(out)?.clone(),
            cache,
            tokens,
            heads,
            kv_heads,
            head_dim,
            rows,
            max_ctx,
            scale,
            chunk,
            step,
        })
    }

    /// The queries `from..to` alone, as attention of their own: every one of its own sequence,
    /// or with `one_seq`, all of the sequence of the first.
    fn rows(&self, from: usize, to: usize, one_seq: bool) -> Result<Attn> {
        let (n, width) = (to - from, self.heads * self.head_dim);
        Ok(Attn {
            q: self.q.slice(from * width, n * width)?,
            kc: self.kc.clone(),
            vc: self.vc.clone(),
            positions: self.positions.slice(from, n)?,
            pages: Pages {
                table: self.pages.table.clone(),
                seq: self.pages.seq.slice(from, n)?,
                pages: KvPages {
                    one_seq,
                    ..self.pages.pages
                },
            },
            out: self.out.slice(from * width, n * width)?,
            tokens: n,
            chunk: None,
            step: self.step.clone(),
            ..*self
        })
    }
}

/// `decode_attention_*` (sm_90): rows (token, query head pairs of one KV head) it takes, keys
/// per warp batch, batches in flight per warp, and warps per block for narrow and wide heads.
const DA_ROWS: usize = 16;
const DA_KEYS: usize = 16;
const DA_STAGES: usize = 2;
const DA_WARPS: usize = 8;
const DA_WARPS_WIDE: usize = 4;

/// Warps per block of `decode_attention_*` (its `DaShape::NWARPS`).
fn decode_warps(head_dim: usize) -> usize {
    if head_dim > WIDE_HEAD_DIM {
        DA_WARPS_WIDE
    } else {
        DA_WARPS
    }
}

/// Keys per tile of `flash_attention_*` (its `FaShape::BN`).
fn flash_tile_keys(head_dim: usize) -> usize {
    if head_dim > WIDE_HEAD_DIM {
        FA_KEYS_WIDE
    } else {
        FA_KEYS
    }
}

/// Tensor-core attention on a bf16/f16 cache, for any number of tokens. With fewer blocks than
/// half the multiprocessors (decode, short prefills), the cache range is split into chunks (about
/// two blocks a multiprocessor) whose partial results `attention_combine_f32` merges. With
/// `out_bf16`, `a.out` is a bf16 view and the output is rounded as it is written. With `runs`
/// (queries of several sequences, each a run of whole row blocks) the blocks start in the order
/// of their causal ranges, longest first, which the kernel works out from the positions; one
/// sequence's rows start in that order anyway, from the last.
fn encode_flash(enc: &mut Encoder, a: &Attn, max_mt: usize, out_bf16: bool, runs: bool) -> Result<()> {
    let (cache, tokens, heads, kv_heads, head_dim, max_ctx) =
        (a.cache, a.tokens, a.heads, a.kv_heads, a.head_dim, a.max_ctx);
    let bn = flash_tile_keys(head_dim);
    let pairs = tokens * (heads / kv_heads);
    // Two row tiles per warp (each K/V fragment used twice) when registers allow and the blocks
    // still number two a multiprocessor (below that, more blocks of one tile won: pp256 16,531
    // to 17,648 tok/s, pp512 +3% on the H200).
    let sms = enc.device.info().sm_count as usize;
    let mt = if max_mt >= 2 && head_dim <= 128 && pairs.div_ceil(2 * 16 * FA_WARPS) * kv_heads >= 2 * sms {
        2
    } else {
        1
    };
    let rows = 16 * FA_WARPS * mt;
    let row_blocks = pairs.div_ceil(rows);
    let blocks = row_blocks * kv_heads;
    // Split only when the blocks would leave more than half the multiprocessors idle: merging
    // the splits of a 512-token prefill (128 blocks, 3 splits) cost 17 µs a layer on the H200, more
    // than the split saved.
    let want = if 2 * blocks >= sms {
        1
    } else {
        (2 * sms).div_ceil(blocks)
    }
    .clamp(1, max_ctx.div_ceil(bn));
    let chunk = max_ctx.div_ceil(want).div_ceil(bn) * bn;
    let splits = max_ctx.div_ceil(chunk);
    let max_smem = enc.device.info().max_shared_per_block;
    let mut smem = (rows + 4 * bn) * (head_dim + 8) * 2 + rows * 4;
    // Ranking the row blocks takes a word of shared memory each.
    let ranked = runs && row_blocks <= FA_RANKED && smem + 4 * row_blocks <= max_smem;
    if ranked {
        smem += 4 * row_blocks;
    }
    if smem > max_smem || splits > MAX_SPLITS {
        return Err(unsupported(format!(
            "attention with head_dim {head_dim} over {splits} splits"
        )));
    }
    let name = format!("flash_attention_{}_{head_dim}_{mt}", float_name(cache)?);
    let kern = enc.kernel(&MODULE, &name)?;
    // With one split the partial-result arguments are unused; the output stands in for them.
    let [pm, pl_buf, pacc] = if splits > 1 {
        partials(enc, tokens * heads * splits, head_dim)?
    } else {
        [a.out.clone(), a.out.clone(), a.out.clone()]
    };
    a.dispatch(enc, &kern)?
        .grid((u32_arg(blocks)?, 1, u32_arg(splits)?))
        .block(u32_arg(32 * FA_WARPS)?)
        .shared_mem(u32_arg(smem)?)
        .write(&a.out)
        .write(&pm)
        .write(&pl_buf)
        .write(&pacc)
        .arg(u32_arg(tokens)?)
        .arg(u32_arg(heads)?)
        .arg(u32_arg(kv_heads)?)
        .arg(u32_arg(a.rows)?)
        .arg(a.scale)
        .arg(u32_arg(chunk)?)
        .arg(u32::from(out_bf16))
        .arg(u32::from(ranked))
        .record();
    if splits > 1 {
        record_combine(enc, &[pm, pl_buf, pacc], a, splits, out_bf16)?;
    }
    Ok(())
}

/// Whether `encode_attention` takes `a` to `encode_decode`: Hopper, a bf16/f16 cache of a flash
/// head dim, and up to `DA_ROWS` rows of a KV head's group a launch (one sequence's tokens
/// together, or a token of each of several sequences alone).
fn decode_fits(enc: &Encoder, a: &Attn) -> bool {
    let one_seq = a.pages.pages.one_seq || a.tokens == 1;
    let group = a.heads / a.kv_heads;
    let rows = if one_seq { a.tokens * group } else { group };
    matches!(a.cache, DType::BF16 | DType::F16)
        && FLASH_HEAD_DIMS.contains(&a.head_dim)
        && rows <= DA_ROWS
        && enc.device.info().compute_capability.0 >= 9
}

/// Decode on a bf16/f16 cache in one kernel: `decode_attention_*` splits the cache over one wave
/// of blocks, which start streaming their rows of past tokens before the kernel ahead of them
/// finishes, then wait for each other and merge the blocks' results, each a share (see
/// `attention.cu`). With `out_bf16`, `a.out` is a bf16 view and the kernel rounds into it.
fn encode_decode(enc: &mut Encoder, a: &Attn, out_bf16: bool) -> Result<()> {
    let name = format!("decode_attention_{}_{}", float_name(a.cache)?, a.head_dim);
    let kern = enc.kernel(&MODULE, &name)?;
    let g = DecodeGrid::new(enc, a, &kern, 0)?;
    // Without a batched step, the launch holds every token of its one sequence.
    let (step_pos, step_seq, step_tokens) = match &a.step {
        Some((p, s, n)) => (p, s, *n),
        None => (&a.positions, &a.pages.seq, 0),
    };
    a.dispatch(enc, &kern)?
        .read(step_pos)
        .read(step_seq)
        .arg(u32_arg(step_tokens)?)
        .grid(g.grid)
        .block(g.block)
        .shared_mem(g.smem)
        .write(&a.out)
        .write(&g.part)
        .read_write(&g.counters)
        .arg(u32_arg(a.tokens)?)
        .arg(u32_arg(a.heads)?)
        .arg(u32_arg(a.kv_heads)?)
        .arg(u32_arg(a.rows)?)
        .arg(a.scale)
        .arg(u32_arg(g.chunk)?)
        .arg(u32::from(out_bf16))
        .record();
    Ok(())
}

/// The launch of a `decode_attention_*` kernel for `a`: its grid, block, shared memory (with
/// `extra` bytes past the rings), chunk of keys a split and its workspaces.
struct DecodeGrid {
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    chunk: usize,
    part: Buffer,
    counters: Buffer,
}

impl DecodeGrid {
    fn new(enc: &mut Encoder, a: &Attn, kern: &Kernel, extra: usize) -> Result<Self> {
        let (kv_heads, head_dim, max_ctx) = (a.kv_heads, a.head_dim, a.max_ctx);
        let stride = head_dim + 8;
        let smem =
            DA_ROWS * stride * 2 + decode_warps(head_dim) * DA_STAGES * 2 * DA_KEYS * stride * 2 + extra;
        if smem > enc.device.info().max_shared_per_block {
            return Err(unsupported(format!("decode attention with head_dim {head_dim}")));
        }
        // At most one block per multiprocessor, the same number of splits per KV head (each split
        // a whole number of rounds of the warps' batches, and at least `Config::decode_split_keys`
        // keys): the blocks of a KV head wait for each other, so all must be resident at once,
        // and a second wave would double the time anyway.
        let block = 32 * decode_warps(head_dim) as u32;
        let wave = enc
            .device
            .max_active_blocks(kern, block, u32_arg(smem)?)?
            .min(enc.device.info().sm_count as usize);
        // One z per token when each token has its own sequence, else one for all.
        let zs = if a.pages.pages.one_seq { 1 } else { a.tokens };
        let want = (wave / (kv_heads * zs)).max(1);
        let round = decode_warps(head_dim) * DA_KEYS;
        let chunk = max_ctx
            .div_ceil(want)
            .max(enc.device.decode_split_keys())
            .div_ceil(round)
            * round;
        let splits = max_ctx.div_ceil(chunk);
        // Per (z, KV head, split, row): the split's accumulator, then max and sum and two unused
        // floats; two counters per (z, KV head).
        let record = head_dim + 4;
        let part = enc.workspace(DType::F32, zs * kv_heads * splits * DA_ROWS * record)?;
        let counters = enc.counters(2 * zs * kv_heads)?;
        Ok(DecodeGrid {
            grid: (u32_arg(splits)?, u32_arg(kv_heads)?, u32_arg(zs)?),
            block,
            smem: u32_arg(smem)?,
            chunk,
            part,
            counters,
        })
    }
}

/// Head dims of `decode_attention_inputs_*`.
const DECODE_INPUTS_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// One token's `AttentionInputs` and the `Attention` that reads them, as one
/// `decode_attention_inputs_*` kernel (Hopper, bf16/f16 caches, its head dims, norm weights of
/// f32 or bf16 or none): the queries never make the round trip through memory before attention,
/// and one kernel of a decode layer's chain goes. Returns false, recording nothing, for any
/// other pair.
pub(crate) fn encode_inputs_and_decode(inputs: &Op, attention: &Op, enc: &mut Encoder) -> Result<bool> {
    if !inputs.may_join(attention) {
        return Ok(false);
    }
    let i = Inputs::new(enc, inputs)?;
    let hopper = enc.device.info().compute_capability.0 >= 9;
    let weights = match i.weights {
        None | Some(DType::F32) => Some("f32"),
        Some(DType::BF16) => Some("bf16"),
        Some(_) => None,
    };
    let fits = hopper
        && enc.device.fused_attention()
        && i.tokens == 1
        && matches!(i.cache, DType::BF16 | DType::F16)
        && DECODE_INPUTS_HEAD_DIMS.contains(&i.head_dim)
        && i.heads % i.kv_heads == 0
        && i.heads / i.kv_heads <= DA_ROWS;
    let Some(weights) = weights.filter(|_| fits) else {
        return Ok(false);
    };
    let a = Attn::new(enc, attention)?;
    let name = format!(
        "decode_attention_inputs_{}_{weights}_{}",
        float_name(i.cache)?,
        i.head_dim
    );
    let kern = enc.kernel(&MODULE, &name)?;
    // Each warp's head, in f32, past the rings.
    let g = DecodeGrid::new(enc, &a, &kern, decode_warps(i.head_dim) * i.head_dim * 4)?;
    let b = enc.dispatch(&kern).grid(g.grid).block(g.block).shared_mem(g.smem);
    i.args(b)?
        .write(&a.out)
        .write(&g.part)
        .read_write(&g.counters)
        .arg(u32_arg(i.heads)?)
        .arg(u32_arg(i.kv_heads)?)
        .arg(u32_arg(i.rows)?)
        .arg(a.scale)
        .arg(u32_arg(g.chunk)?)
        .arg(u32_arg(i.q_stride())?)
        .arg(u32_arg(i.rot_dim)?)
        .arg(i.scaling)
        .record();
    Ok(true)
}

/// An `Op::AttentionInputs` as its encoders use it: the buffers resolved, the caches' and the
/// norm weights' dtypes (checked here), and the shape.
struct Inputs {
    qkv: Buffer,
    q: Buffer,
    gate: Option<Buffer>,
    norms: Option<(Buffer, Buffer, f32, NormKind)>,
    positions: Buffer,
    inv_freq: Buffer,
    kc: Buffer,
    vc: Buffer,
    pages: Pages,
    cache: DType,
    /// The norm weights' dtype, None without norms.
    weights: Option<DType>,
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rot_dim: usize,
    scaling: f32,
    rows: usize,
}

impl Inputs {
    fn new(enc: &Encoder, op: &Op) -> Result<Self> {
        let Op::AttentionInputs {
            qkv,
            q,
            gate,
            norms,
            positions,
            inv_freq,
            k_cache,
            v_cache,
            pages,
            tokens,
            heads,
            kv_heads,
            head_dim,
            rot_dim,
            scaling,
            rows,
        } = *op
        else {
            unreachable!("called for attention inputs")
        };
        let weights = match norms {
            Some(n) if enc.dtype(n.q) != enc.dtype(n.k) => {
                return Err(unsupported("q and k norm weights of different dtypes".into()))
            }
            Some(n) => Some(enc.dtype(n.q)),
            None => None,
        };
        Ok(Inputs {
            qkv: enc.buf(qkv)?.clone(),
            q: enc.buf(q)?.clone(),
            gate: gate.map(|g| enc.buf(g).cloned()).transpose()?,
            norms: match norms {
                Some(n) => Some((enc.buf(n.q)?.clone(), enc.buf(n.k)?.clone(), n.eps, n.kind)),
                None => None,
            },
            positions: enc.buf(positions)?.clone(),
            inv_freq: enc.buf(inv_freq)?.clone(),
            kc: enc.buf(k_cache)?.clone(),
            vc: enc.buf(v_cache)?.clone(),
            pages: Pages::new(enc, pages)?,
            cache: cache_dtype(enc, k_cache, v_cache)?,
            weights,
            tokens,
            heads,
            kv_heads,
            head_dim,
            rot_dim,
            scaling,
            rows,
        })
    }

    /// A head's values in qkv's row: q's, followed by its gate's when gated.
    fn q_stride(&self) -> usize {
        if self.gate.is_some() {
            2 * self.head_dim
        } else {
            self.head_dim
        }
    }

    /// The arguments both kernels of the inputs start with: qkv, q, the gate, the norm weights,
    /// epsilon and kind, the positions, inv_freq, the caches and the pages. Absent gates and
    /// norm weights are null pointers.
    fn args<'e>(&self, b: DispatchBuilder<'e>) -> Result<DispatchBuilder<'e>> {
        let b = b.read(&self.qkv).write(&self.q);
        let b = match &self.gate {
            Some(g) => b.write(g),
            None => b.arg(0u64),
        };
        let b = match &self.norms {
            Some((qw, kw, eps, kind)) => b
                .read(qw)
                .read(kw)
                .arg(*eps)
                .arg(i32::from(*kind == NormKind::ZeroCentered)),
            None => b.arg(0u64).arg(0u64).arg(0f32).arg(0i32),
        };
        let b = b
            .read(&self.positions)
            .read(&self.inv_freq)
            .read_write(&self.kc)
            .read_write(&self.vc);
        self.pages.args(b)
    }
}

/// Shared memory of `attention_split_*`: queries, the warps' partial results, and each warp's 32 K
/// and 32 V rows (padded by 8 values).
fn split_smem(head_dim: usize, cache_bytes: usize) -> usize {
    (GROUP * head_dim + 2 * DEC_WARPS * GROUP + DEC_WARPS * GROUP * head_dim) * 4
        + DEC_WARPS * 64 * (head_dim + 8) * cache_bytes
}

/// Decode attention: the cache split into chunks processed in parallel, then merged (with
/// `out_bf16`, rounded into `a.out`, a bf16 view).
fn encode_split(enc: &mut Encoder, a: &Attn, out_bf16: bool) -> Result<()> {
    let (cache, tokens, heads, kv_heads, head_dim, max_ctx) =
        (a.cache, a.tokens, a.heads, a.kv_heads, a.head_dim, a.max_ctx);
    let pl = match head_dim.div_ceil(32) {
        0..=2 => 2,
        3 => 3,
        4 => 4,
        _ => 8,
    };
    let subgroups = (heads / kv_heads).div_ceil(GROUP);
    let per_split = kv_heads * subgroups * tokens;
    // About two blocks per multiprocessor, each chunk a whole number of warp batches.
    let want = (2 * enc.device.info().sm_count as usize)
        .div_ceil(per_split)
        .clamp(1, max_ctx.div_ceil(DEC_WARPS * 32));
    let chunk = max_ctx.div_ceil(want).div_ceil(DEC_WARPS * 32) * DEC_WARPS * 32;
    let splits = max_ctx.div_ceil(chunk);
    let [pm, pl_buf, pacc] = partials(enc, tokens * heads * splits, head_dim)?;
    let smem = split_smem(head_dim, cache.size_in_bytes());
    if smem > enc.device.info().max_shared_per_block || splits > MAX_SPLITS {
        return Err(unsupported(format!(
            "decode attention with head_dim {head_dim} over {splits} splits"
        )));
    }
    let name = format!("attention_split_{}_{pl}", float_name(cache)?);
    let kern = enc.kernel(&MODULE, &name)?;
    a.dispatch(enc, &kern)?
        .grid((u32_arg(kv_heads * subgroups)?, u32_arg(splits)?, u32_arg(tokens)?))
        .block(u32_arg(32 * DEC_WARPS)?)
        .shared_mem(u32_arg(smem)?)
        .write(&pm)
        .write(&pl_buf)
        .write(&pacc)
        .arg(u32_arg(heads)?)
        .arg(u32_arg(kv_heads)?)
        .arg(u32_arg(head_dim)?)
        .arg(u32_arg(a.rows)?)
        .arg(a.scale)
        .arg(u32_arg(chunk)?)
        .record();
    record_combine(enc, &[pm, pl_buf, pacc], a, splits, out_bf16)
}

/// Per (row, split) partial results of split attention: max, sum, and the unnormalised
/// `[head_dim]` accumulator, for `rows` = rows x splits.
fn partials(enc: &mut Encoder, rows: usize, head_dim: usize) -> Result<[Buffer; 3]> {
    Ok([
        enc.workspace(DType::F32, rows)?,
        enc.workspace(DType::F32, rows)?,
        enc.workspace(DType::F32, [rows, head_dim])?,
    ])
}

/// `attention_combine_*`: each row (a token's head) of `a`'s output = the merge of the row's
/// `splits` partial results, in f32 or with `out_bf16` rounded into the output's bf16 view.
fn record_combine(
    enc: &mut Encoder,
    [pm, pl, pacc]: &[Buffer; 3],
    a: &Attn,
    splits: usize,
    out_bf16: bool,
) -> Result<()> {
    let (rows, head_dim) = (a.tokens * a.heads, a.head_dim);
    // Many splits (decode over a long cache): a block per row spreads them over its threads.
    // Few: a warp per row, so prefill's many rows are not a block each.
    let (name, grid, block) = if splits > COMBINE_LOADS {
        ("attention_combine_many_f32", rows, u32_arg(COMBINE_THREADS)?)
    } else {
        (
            "attention_combine_f32",
            rows.div_ceil(COMBINE_WARPS),
            u32_arg(32 * COMBINE_WARPS)?,
        )
    };
    let combine = enc.kernel(&MODULE, name)?;
    enc.dispatch(&combine)
        .grid(u32_arg(grid)?)
        .block(block)
        .read(pm)
        .read(pl)
        .read(pacc)
        .write(&a.out)
        .arg(u32_arg(head_dim)?)
        .arg(u32_arg(splits)?)
        .arg(u32_arg(rows)?)
        .arg(u32::from(out_bf16))
        .record();
    Ok(())
}

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match *op {
        Op::KvAppend {
            k,
            v,
            positions,
            k_cache,
            v_cache,
            pages,
            tokens,
            kv_heads,
            head_dim,
            rows,
        } => {
            let name = float_name(cache_dtype(enc, k_cache, v_cache)?)?;
            let pages = Pages::new(enc, pages)?;
            let kern = enc.kernel(&MODULE, &format!("kv_append_{name}"))?;
            let (k, v, p) = (
                enc.buf(k)?.clone(),
                enc.buf(v)?.clone(),
                enc.buf(positions)?.clone(),
            );
            let (kc, vc) = (enc.buf(k_cache)?.clone(), enc.buf(v_cache)?.clone());
            let b = enc
                .dispatch(&kern)
                .cover(tokens * kv_heads * head_dim, 256)
                .read(&k)
                .read(&v)
                .read(&p)
                .read_write(&kc)
                .read_write(&vc);
            pages
                .args(b)?
                .arg(u32_arg(tokens)?)
                .arg(u32_arg(kv_heads)?)
                .arg(u32_arg(head_dim)?)
                .arg(u32_arg(rows)?)
                .record();
        }
        Op::AttentionInputs { .. } => {
            let i = Inputs::new(enc, op)?;
            if i.head_dim > MAX_HEAD_DIM {
                return Err(unsupported(format!("head_dim {} > {MAX_HEAD_DIM}", i.head_dim)));
            }
            let (cache, weights) = (float_name(i.cache)?, float_name(i.weights.unwrap_or(DType::F32))?);
            let many = i.tokens >= AI_WARPS_MIN_TOKENS;
            let by_rows = many && inputs_by_rows(i.head_dim, i.rot_dim);
            let name = match (by_rows, many) {
                (true, _) => format!("attention_inputs_rows_{cache}_{weights}_{}", i.head_dim),
                (false, true) => format!("attention_inputs_warps_{cache}_{weights}"),
                (false, false) => format!("attention_inputs_{cache}_{weights}"),
            };
            let kern = enc.kernel(&MODULE, &name)?;
            let (grid_y, block) = match (by_rows, many) {
                (true, _) => (
                    (i.heads + 2 * i.kv_heads).div_ceil(AI_ROW_WARPS * AI_ROW_BATCH),
                    32 * AI_ROW_WARPS,
                ),
                (false, true) => ((i.heads + 2 * i.kv_heads).div_ceil(AI_WARPS), 32 * AI_WARPS),
                (false, false) => (
                    i.heads + 2 * i.kv_heads,
                    ((i.head_dim / 2).div_ceil(32) * 32).clamp(32, 128),
                ),
            };
            let b = enc
                .dispatch(&kern)
                .grid((u32_arg(i.tokens)?, u32_arg(grid_y)?))
                .block(u32_arg(block)?);
            i.args(b)?
                .arg(u32_arg(i.heads)?)
                .arg(u32_arg(i.kv_heads)?)
                .arg(u32_arg(i.head_dim)?)
                .arg(u32_arg(i.q_stride())?)
                .arg(u32_arg(i.rot_dim)?)
                .arg(i.scaling)
                .arg(u32_arg(i.rows)?)
                .record();
        }
        Op::Attention { out, .. } => {
            let mut a = Attn::new(enc, op)?;
            // A batched step's own tokens, then a chunk of one more sequence: the tokens as
            // decode, the chunk as one sequence's prefill or several sequences' runs.
            let mixed = match a.chunk {
                Some(c) if !a.pages.pages.one_seq && c.from > 0 && c.from < a.tokens => Some(c),
                _ => None,
            };
            // An output only products that round it read is rounded as it is written
            // (`linear::read_rounded_only`), with no conversion before them, when every kernel
            // that writes it can round.
            let rounds = match mixed {
                Some(c) => {
                    let chunk_rounds = match c.run {
                        0 => path(enc, &a.rows(c.from, a.tokens, true)?) != Path::Plain,
                        run => {
                            let rows = a.rows(c.from, a.tokens, false)?;
                            runs_flash(&rows, run).is_some() || path(enc, &rows) != Path::Plain
                        }
                    };
                    chunk_rounds && path(enc, &a.rows(0, c.from, false)?) != Path::Plain
                }
                None => path(enc, &a) != Path::Plain,
            };
            let out_bf16 = rounds && linear::read_rounded_only(enc, out)?;
            if out_bf16 {
                a.out = enc.rounded_view(out)?;
                enc.mark_rounded(out);
            }
            match mixed {
                Some(c) => {
                    encode_attention(enc, &a.rows(0, c.from, false)?, out_bf16)?;
                    match c.run {
                        0 => encode_attention(enc, &a.rows(c.from, a.tokens, true)?, out_bf16)?,
                        run => encode_runs(enc, &a.rows(c.from, a.tokens, false)?, run, out_bf16)?,
                    }
                }
                None => encode_attention(enc, &a, out_bf16)?,
            }
        }
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}

/// The flash kernel's row tiles a warp (2 or 1) for `a`'s queries (each of its own sequence) in
/// runs of `run` tokens, each run one sequence's but for padding, where its blocks' rows are whole
/// tokens of one run; None where they are not, or the cache or head dim has no flash kernel.
fn runs_flash(a: &Attn, run: usize) -> Option<usize> {
    let group = a.heads / a.kv_heads;
    let flash = matches!(a.cache, DType::BF16 | DType::F16) && FLASH_HEAD_DIMS.contains(&a.head_dim);
    let fits = |mt: usize| {
        let rows = 16 * FA_WARPS * mt;
        rows % group == 0 && run % (rows / group) == 0
    };
    match (fits(1), fits(2)) {
        (true, two) if flash => Some(if two { 2 } else { 1 }),
        _ => None,
    }
}

/// Attention of `a`'s queries in runs of `run` tokens: flash blocks that each take one run's rows
/// (the block's sequence is its first token's) where `runs_flash` allows, else each token on its
/// own. With `out_bf16` the output is rounded as it is written (`encode_attention`).
fn encode_runs(enc: &mut Encoder, a: &Attn, run: usize, out_bf16: bool) -> Result<()> {
    match runs_flash(a, run) {
        Some(mt) => encode_flash(enc, a, mt, out_bf16, true),
        None => encode_attention(enc, a, out_bf16),
    }
}

/// The kernels attention takes, the most specialised first.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    /// `encode_decode`.
    Decode,
    /// `encode_flash`.
    Flash,
    /// `encode_split`.
    Split,
    /// The plain `attention_*` kernel, whose output is f32 only.
    Plain,
}

/// The first kernel that fits `a`'s shape.
fn path(enc: &Encoder, a: &Attn) -> Path {
    let (cache, head_dim) = (a.cache, a.head_dim);
    let one_seq = a.pages.pages.one_seq || a.tokens == 1;
    // One decode token's group (or a few tokens of a small group) in one kernel; with a sequence
    // per token, each token's group alone.
    if decode_fits(enc, a) {
        return Path::Decode;
    }
    if matches!(cache, DType::BF16 | DType::F16) && FLASH_HEAD_DIMS.contains(&head_dim) && one_seq {
        return Path::Flash;
    }
    // The split kernel when its shared memory fits (f32 caches up to head dim 128).
    let split_fits = split_smem(head_dim, cache.size_in_bytes()) <= enc.device.info().max_shared_per_block;
    // A sequence per token: the split kernel takes each token alone, whatever their number.
    let few = a.tokens <= SPLIT_MAX_TOKENS || !one_seq;
    if few && head_dim % 8 == 0 && head_dim <= MAX_HEAD_DIM && split_fits {
        return Path::Split;
    }
    Path::Plain
}

/// Attention of `a`'s queries by the first kernel that fits their shape (`path`). With
/// `out_bf16`, `a.out` is a bf16 view and the kernel (or the merge of its splits) rounds into it;
/// the plain kernel cannot.
fn encode_attention(enc: &mut Encoder, a: &Attn, out_bf16: bool) -> Result<()> {
    let (cache, tokens, heads, kv_heads, head_dim) = (a.cache, a.tokens, a.heads, a.kv_heads, a.head_dim);
    match path(enc, a) {
        Path::Decode => return encode_decode(enc, a, out_bf16),
        Path::Flash => return encode_flash(enc, a, 2, out_bf16, false),
        Path::Split => return encode_split(enc, a, out_bf16),
        Path::Plain => {}
    }
    if head_dim > MAX_HEAD_DIM {
        return Err(unsupported(format!("head_dim {head_dim} > {MAX_HEAD_DIM}")));
    }
    if out_bf16 {
        return Err(unsupported(format!(
            "a rounded output from attention_{}",
            float_name(cache)?
        )));
    }
    let kern = enc.kernel(&MODULE, &format!("attention_{}", float_name(cache)?))?;
    a.dispatch(enc, &kern)?
        .grid(u32_arg(tokens * heads)?)
        .block(u32_arg(32 * WARPS)?)
        .write(&a.out)
        .arg(u32_arg(heads)?)
        .arg(u32_arg(kv_heads)?)
        .arg(u32_arg(head_dim)?)
        .arg(u32_arg(a.rows)?)
        .arg(a.scale)
        .record();
    Ok(())
}
