//! Gated DeltaNet: conv1d, gates and the delta rule, `kernels/deltanet.cu`. The delta rule runs
//! as the recurrence with the state in registers for key sizes 64, 128 and 256 (in shared memory
//! otherwise). `DeltaAlgo::Chunked` runs the chunked form instead (`delta_chunked_*`, chunks of
//! 64 tokens whatever size is asked, key sizes 64 and 128); `Auto` keeps the recurrence, which
//! measures faster on an H200 for now (BENCHMARKS.md). A head is spread over blocks of 32 state
//! columns in the register and chunked kernels.

use kestrel_core::ir::{DeltaAlgo, Op, StateRows};

use super::common::{float_name, op_module, u32_arg, unsupported};
use kestrel_cuda_rt::{Buffer, DispatchBuilder, ModuleSource, Result};

use crate::encoder::Encoder;

/// `deltanet.cu`'s window limit.
const KERNEL_MAX: usize = 8;

/// Tokens per chunk of `delta_chunked_*` (`DC` in deltanet.cu).
const DELTA_CHUNK: usize = 64;
/// State columns a block of `delta_rule_regs_*` or `delta_chunked_*` takes; threads to a column
/// of `delta_chunked_*` (`CP`); threads of a `delta_rule_regs_*` block (four to a column).
const BLOCK_COLUMNS: usize = 32;
const CHUNK_THREADS_PER_COLUMN: usize = 8;
const REGS_THREADS: usize = 4 * BLOCK_COLUMNS;

/// Bytes of `ChunkSmem<dk>` (deltanet.cu): q, k and W rows padded by 4 floats, the two
/// triangular matrices, 32 padded columns of V, and four per-token vectors.
const fn chunk_smem(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    4 * (3 * c * (dk + 4) + 2 * c * c + c * 33 + 4 * c)
}

pub(crate) const MODULE: ModuleSource = op_module(
    "deltanet",
    include_str!("../../kernels/deltanet.cu"),
    &[
        ("KERNEL_MAX", KERNEL_MAX as i64),
        ("DC", DELTA_CHUNK as i64),
        ("CP", CHUNK_THREADS_PER_COLUMN as i64),
        ("DELTA_REGS_THREADS", REGS_THREADS as i64),
        ("DELTA_CHUNK_SMEM_64", chunk_smem(64) as i64),
        ("DELTA_CHUNK_SMEM_128", chunk_smem(128) as i64),
    ],
);

/// A state op's rows, resolved: the sequence ids (None: one row) and the runs the kernels'
/// grids take (one per token when each token has its own sequence, else one).
struct Rows {
    seq: Option<Buffer>,
    step: u32,
    runs: usize,
}

impl Rows {
    fn new(enc: &Encoder, rows: Option<StateRows>, tokens: usize) -> Result<Rows> {
        Ok(match rows {
            None => Rows {
                seq: None,
                step: 0,
                runs: 1,
            },
            Some(r) => Rows {
                seq: Some(enc.buf(r.seq)?.clone()),
                step: u32::from(!r.one_seq),
                runs: if r.one_seq { 1 } else { tokens },
            },
        })
    }

    /// The kernels' (seq, seq_step) arguments.
    fn args<'e>(&self, b: DispatchBuilder<'e>) -> DispatchBuilder<'e> {
        match &self.seq {
            Some(s) => b.read(s).arg(self.step),
            None => b.arg(0u64).arg(0u32),
        }
    }
}

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match *op {
        Op::CausalConv1d {
            x,
            w,
            state,
            rows,
            out,
            tokens,
            channels,
            kernel,
        } => {
            let rows = Rows::new(enc, rows, tokens)?;
            if kernel > KERNEL_MAX {
                return Err(unsupported(format!("conv kernel {kernel} > {KERNEL_MAX}")));
            }
            let kern = enc.kernel(&MODULE, &format!("causal_conv1d_{}", float_name(enc.dtype(w))?))?;
            let (x, w, s, o) = (
                enc.buf(x)?.clone(),
                enc.buf(w)?.clone(),
                enc.buf(state)?.clone(),
                enc.buf(out)?.clone(),
            );
            let b = enc
                .dispatch(&kern)
                .grid((u32_arg(channels.div_ceil(128))?, u32_arg(rows.runs)?))
                .block(128)
                .read(&x)
                .read(&w)
                .read_write(&s);
            rows.args(b)
                .write(&o)
                .arg(u32_arg(tokens)?)
                .arg(u32_arg(channels)?)
                .arg(u32_arg(kernel)?)
                .record();
        }
        Op::DeltaGates {
            a,
            b,
            a_log,
            dt_bias,
            g,
            beta,
            tokens,
            heads,
        } => {
            let name = format!(
                "delta_gates_{}_{}",
                float_name(enc.dtype(a_log))?,
                float_name(enc.dtype(dt_bias))?
            );
            let kern = enc.kernel(&MODULE, &name)?;
            let (a, b, al, dt) = (
                enc.buf(a)?.clone(),
                enc.buf(b)?.clone(),
                enc.buf(a_log)?.clone(),
                enc.buf(dt_bias)?.clone(),
            );
            let (g, beta) = (enc.buf(g)?.clone(), enc.buf(beta)?.clone());
            let n = tokens * heads;
            enc.dispatch(&kern)
                .cover(n, 256)
                .read(&a)
                .read(&b)
                .read(&al)
                .read(&dt)
                .write(&g)
                .write(&beta)
                .arg(u32_arg(n)?)
                .arg(u32_arg(heads)?)
                .record();
        }
        Op::DeltaRule {
            q,
            k,
            v,
            g,
            beta,
            state,
            rows,
            out,
            tokens,
            k_heads,
            v_heads,
            k_dim,
            v_dim,
            algo,
        } => {
            let rows = Rows::new(enc, rows, tokens)?;
            let (q, k, v) = (enc.buf(q)?.clone(), enc.buf(k)?.clone(), enc.buf(v)?.clone());
            let (g, b, s, o) = (
                enc.buf(g)?.clone(),
                enc.buf(beta)?.clone(),
                enc.buf(state)?.clone(),
                enc.buf(out)?.clone(),
            );
            // Chunked when asked for, where the key size allows (`Auto` takes the recurrence: the
            // chunked kernel still measures slower); otherwise the state in registers, each
            // head over dv / 32 blocks, where the key size allows.
            let chunked = tokens > 1
                && rows.runs == 1
                && matches!(algo, DeltaAlgo::Chunked { .. })
                && matches!(k_dim, 64 | 128);
            if chunked || matches!(k_dim, 64 | 128 | 256) {
                let (name, smem) = if chunked {
                    (format!("delta_chunked_{k_dim}"), chunk_smem(k_dim))
                } else {
                    (format!("delta_rule_regs_{}", k_dim / 4), 0)
                };
                let kern = enc.kernel(&MODULE, &name)?;
                let d = enc
                    .dispatch(&kern)
                    .grid((
                        u32_arg(v_heads)?,
                        u32_arg(v_dim.div_ceil(BLOCK_COLUMNS))?,
                        u32_arg(rows.runs)?,
                    ))
                    .block(u32_arg(if chunked {
                        CHUNK_THREADS_PER_COLUMN * BLOCK_COLUMNS
                    } else {
                        REGS_THREADS
                    })?)
                    .shared_mem(u32_arg(smem)?)
                    .read(&q)
                    .read(&k)
                    .read(&v)
                    .read(&g)
                    .read(&b)
                    .read_write(&s);
                rows.args(d)
                    .write(&o)
                    .arg(u32_arg(tokens)?)
                    .arg(u32_arg(k_heads)?)
                    .arg(u32_arg(v_heads)?)
                    .arg(u32_arg(v_dim)?)
                    .record();
                return Ok(());
            }
            let shared = (k_dim * v_dim + 2 * k_dim) * 4;
            if shared > enc.device.info().max_shared_per_block {
                return Err(unsupported(format!(
                    "state {k_dim}x{v_dim} exceeds shared memory"
                )));
            }
            let kern = enc.kernel(&MODULE, "delta_rule_f32")?;
            let d = enc
                .dispatch(&kern)
                .grid((u32_arg(v_heads)?, u32_arg(rows.runs)?))
                .block(128)
                .shared_mem(u32_arg(shared)?)
                .read(&q)
                .read(&k)
                .read(&v)
                .read(&g)
                .read(&b)
                .read_write(&s);
            rows.args(d)
                .write(&o)
                .arg(u32_arg(tokens)?)
                .arg(u32_arg(k_heads)?)
                .arg(u32_arg(v_heads)?)
                .arg(u32_arg(k_dim)?)
                .arg(u32_arg(v_dim)?)
                .record();
        }
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}
