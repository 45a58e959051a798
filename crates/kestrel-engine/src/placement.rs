//! Where a model's bytes go when they may not all fit on the GPU. Everything but the routed
//! experts always stays resident (non-expert weights, KV caches and recurrent states at the
//! context, the largest activation arena); the experts fill the rest of the GPU budget as
//! caches of expert-sized slots, the same number in every MoE layer, beside a staging area of
//! one layer's experts for long prefill chunks, and the ones outside them live in host memory
//! (pinned) and, past the host budget, on disk. The plan is worked out from the graphs a run
//! would build, so it counts weights as loaded (quantised on load when asked).

use std::fmt;
use std::str::FromStr;

use kestrel_core::ir::{BufKind, Op};
use kestrel_core::planner::Plan;
use kestrel_core::quant::QuantFormat;
use kestrel_core::DType;
use kestrel_model::{Forward, ForwardSpec, KvPool, LayerKind, ModelConfig, Weights, KV_BLOCK};

use crate::error::{EngineError, Result};

/// A number of bytes as a user writes it: `8GiB`, `16G` (binary: K, M, G, T and KiB ... TiB),
/// `500MB` (decimal: KB ... TB), or plain bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<ByteSize, String> {
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = t.split_at(split);
        let unit = unit.trim();
        let scale: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "m" | "mib" => 1 << 20,
            "g" | "gib" => 1 << 30,
            "t" | "tib" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
                ))
            }
        };
        let value: f64 = number
            .parse()
            .map_err(|_| format!("{s:?} is not a size such as 8GiB, 16G or 500MB"))?;
        let bytes = value * scale as f64;
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(format!("{s:?} is too large"));
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        match self.0 {
            n if n >= 1 << 30 => write!(f, "{:.2} GiB", b / (1u64 << 30) as f64),
            n if n >= 1 << 20 => write!(f, "{:.1} MiB", b / (1u64 << 20) as f64),
            n if n >= 1 << 10 => write!(f, "{:.1} KiB", b / 1024.0),
            n => write!(f, "{n} B"),
        }
    }
}

/// What a run holds, for a placement: the model, the context and the formats.
#[derive(Debug, Clone, Copy)]
pub struct RunShape {
    /// Positions the KV caches hold.
    pub ctx: usize,
    pub cache_dtype: DType,
    /// Dense weights quantised on load to this format.
    pub quant: Option<QuantFormat>,
    /// Tokens of a prefill chunk (its activations are the largest arena).
    pub prefill_chunk: usize,
    /// The KV caches as a pool for several sequences.
    pub pool: Option<KvPool>,
}

/// Where a model's bytes go under a GPU budget (and a host budget).
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Bytes that always stay on the GPU: weights but the routed experts, KV caches and
    /// recurrent states, the largest activation arena.
    pub resident_bytes: u64,
    /// Of those, the weights.
    pub resident_weight_bytes: u64,
    /// Bytes of every routed expert, and of one expert's span (the unit a slot holds).
    pub expert_bytes: u64,
    pub expert_span: u64,
    /// MoE layers, experts per layer, experts a token routes to in each.
    pub moe_layers: usize,
    pub experts_per_layer: usize,
    pub top_k: usize,
    /// Experts the GPU holds: all of them when the model fits, else the caches' slots
    /// (`slots_per_layer` in each MoE layer's cache).
    pub gpu_experts: usize,
    pub slots_per_layer: usize,
    /// Bytes of the staging area longer prefill chunks copy a layer's experts into (when
    /// streaming): one layer's experts, or two when whole layers are staged ahead.
    pub staging_bytes: u64,
    /// Prefill chunks long enough to use most of a layer's experts copy whole layers ahead
    /// into two staging buffers, so the copies overlap the compute of the layers before
    /// (`kestrel_model::Streamed::stage_ahead`): when they are that long, at least two layers
    /// are in host memory, and the budget holds the second buffer.
    pub stage_ahead: bool,
    /// Where the streamed experts are copied from: host memory, whole layers up to the host
    /// budget (the first layers to miss), and the checkpoint on disk for the other layers.
    pub host_experts: usize,
    pub disk_experts: usize,
    /// Bytes a decode token copies to the GPU if routing were uniform (each routed expert hits
    /// with the probability the cache's share of the experts gives).
    pub uniform_bytes_per_token: f64,
}

impl Placement {
    /// Every expert on the GPU: nothing streams.
    pub fn resident(&self) -> bool {
        self.gpu_experts == self.moe_layers * self.experts_per_layer
    }

    /// MoE layers whose experts `host_bytes` of host memory holds (None: all).
    pub fn host_layers(&self, host_bytes: Option<u64>) -> usize {
        let layer = (self.experts_per_layer as u64 * self.expert_span).max(1);
        host_bytes.map_or(self.moe_layers, |h| ((h / layer) as usize).min(self.moe_layers))
    }

    /// The smallest GPU budget that streams: the resident bytes, the staging area of one
    /// layer's experts (a long prefill chunk uses them all at once) and in every MoE layer's
    /// cache a slot for each expert a token takes.
    pub fn min_gpu_bytes(&self) -> u64 {
        self.resident_bytes
            + self.experts_per_layer as u64 * self.expert_span
            + (self.moe_layers * self.top_k) as u64 * self.expert_span
    }

    /// The pool of KV blocks for `seqs` sequences of `shape.ctx` positions under `gpu_bytes`:
    /// every sequence's whole context when the model fits with it, else as many blocks as the
    /// memory left beside every expert holds, at least one sequence's whole context; when the
    /// model does not fit even so (its experts stream), one sequence's (the experts' cache
    /// gets the rest).
    pub fn kv_pool(
        config: &ModelConfig,
        weights: &Weights,
        shape: RunShape,
        seqs: usize,
        snapshots: usize,
        gpu_bytes: u64,
    ) -> Result<KvPool> {
        let per_seq = shape.ctx.div_ceil(KV_BLOCK);
        let whole = KvPool {
            seqs,
            blocks: seqs * per_seq,
            snapshots,
        };
        let least = KvPool {
            seqs,
            blocks: per_seq,
            snapshots,
        };
        let with = |pool: KvPool| {
            Placement::plan(
                config,
                weights,
                RunShape {
                    pool: Some(pool),
                    ..shape
                },
                gpu_bytes,
                None,
            )
        };
        // (Too little memory for the whole pool even with the experts streamed is no answer
        // yet: a smaller pool may fit.)
        if matches!(with(whole), Ok(p) if p.resident()) {
            return Ok(whole);
        }
        let p = with(least)?;
        if !p.resident() {
            return Ok(least);
        }
        // What a block costs: its rows in every attention layer's K and V caches.
        let attention = config
            .layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::FullAttention)
            .count();
        let block = (2
            * attention
            * config.kv_heads
            * config.head_dim
            * KV_BLOCK
            * shape.cache_dtype.size_in_bytes())
        .max(1) as u64;
        let spare = gpu_bytes.saturating_sub(p.resident_bytes + p.expert_bytes);
        let blocks = per_seq + (spare / block) as usize;
        Ok(KvPool {
            seqs,
            blocks: blocks.min(whole.blocks),
            snapshots,
        })
    }

    /// Whether `config`'s model stays resident for a run of `shape` under `gpu_bytes` beside
    /// `extra` bytes the backend keeps of its own (the CUDA backend's bf16 copies of projections).
    pub fn resident_beside(
        config: &ModelConfig,
        weights: &Weights,
        shape: RunShape,
        gpu_bytes: u64,
        extra: u64,
    ) -> bool {
        gpu_bytes >= extra
            && Placement::plan(config, weights, shape, gpu_bytes - extra, None).is_ok_and(|p| p.resident())
    }

    /// Where the bytes of `config`'s model go for a run of `shape` with `gpu_bytes` of GPU
    /// memory and `host_bytes` of host memory for experts (None: no limit). A GPU budget too
    /// small for the resident bytes, the staging area and a token's experts in every layer's
    /// cache is an error naming the minimum.
    pub fn plan(
        config: &ModelConfig,
        weights: &Weights,
        shape: RunShape,
        gpu_bytes: u64,
        host_bytes: Option<u64>,
    ) -> Result<Placement> {
        let graph = |tokens: usize| {
            // f32 norm outputs (`new`'s): the larger plan (a CUDA prefill stores some as bf16).
            // With a pool, the sampler's token counts (a row a sequence) are resident too.
            let spec = ForwardSpec {
                quant: shape.quant,
                pool: shape.pool,
                draw_rows: shape.pool.is_some(),
                ..ForwardSpec::new(tokens, shape.ctx, shape.cache_dtype)
            };
            Forward::build(config, weights, spec)
        };
        let decode = graph(1)?;
        let chunk = graph(shape.prefill_chunk.clamp(1, shape.ctx))?;
        let g = &decode.graph;
        let sum = |kind: BufKind| -> u64 {
            g.bufs
                .iter()
                .filter(|d| d.kind == kind)
                .map(|d| d.byte_len() as u64)
                .sum()
        };
        let (mut expert_bytes, mut span, mut layers, mut per_layer, mut top_k) = (0u64, 0u64, 0, 0, 0);
        for node in &g.nodes {
            if let Op::MoeExperts {
                experts, layout, k, ..
            } = node.op
            {
                expert_bytes += g.decl(experts).byte_len() as u64;
                span = span.max(layout.span_bytes() as u64);
                per_layer = per_layer.max(layout.experts);
                top_k = top_k.max(k);
                layers += 1;
            }
        }
        let arena = Plan::new(g).arena_bytes.max(Plan::new(&chunk.graph).arena_bytes) as u64;
        let resident_weight_bytes = sum(BufKind::Weight) - expert_bytes;
        let resident_bytes = resident_weight_bytes + sum(BufKind::State) + arena;
        let total = layers * per_layer;
        let mut p = Placement {
            resident_bytes,
            resident_weight_bytes,
            expert_bytes,
            expert_span: span,
            moe_layers: layers,
            experts_per_layer: per_layer,
            top_k,
            gpu_experts: total,
            slots_per_layer: per_layer,
            staging_bytes: 0,
            stage_ahead: false,
            host_experts: 0,
            disk_experts: 0,
            uniform_bytes_per_token: 0.0,
        };
        if resident_bytes + expert_bytes <= gpu_bytes || total == 0 || top_k == 0 {
            if resident_bytes > gpu_bytes {
                return Err(too_small(gpu_bytes, resident_bytes, "the model"));
            }
            return Ok(p);
        }
        if gpu_bytes < p.min_gpu_bytes() {
            return Err(too_small(
                gpu_bytes,
                p.min_gpu_bytes(),
                &format!(
                    "the resident weights, caches and activations, one layer's {per_layer} experts to \
                     stage and {top_k} slots a layer"
                ),
            ));
        }
        let layer_bytes = per_layer as u64 * span;
        let chunk = shape.prefill_chunk.clamp(1, shape.ctx);
        p.stage_ahead = chunk * top_k >= per_layer
            && p.host_layers(host_bytes) >= 2
            && gpu_bytes >= p.min_gpu_bytes() + layer_bytes;
        p.staging_bytes = layer_bytes * if p.stage_ahead { 2 } else { 1 };
        let room = gpu_bytes - resident_bytes - p.staging_bytes;
        p.slots_per_layer = ((room / (span * layers as u64)) as usize).min(per_layer);
        p.gpu_experts = p.slots_per_layer * layers;
        p.host_experts = p.host_layers(host_bytes) * per_layer;
        p.disk_experts = total - p.host_experts;
        let miss = 1.0 - p.gpu_experts as f64 / total as f64;
        p.uniform_bytes_per_token = (layers * top_k) as f64 * miss * span as f64;
        Ok(p)
    }
}

fn too_small(budget: u64, needed: u64, what: &str) -> EngineError {
    EngineError::Invalid(format!(
        "a GPU budget of {} does not hold {what}: give at least {} ({} bytes)",
        ByteSize(budget),
        ByteSize(needed),
        needed
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        let p = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
        assert_eq!(p("8GiB"), Ok(8 << 30));
        assert_eq!(p("16G"), Ok(16 << 30));
        assert_eq!(p(" 1.5 MiB "), Ok(3 << 19));
        assert_eq!(p("500MB"), Ok(500_000_000));
        assert_eq!(p("4096"), Ok(4096));
        assert!(p("8 furlongs").unwrap_err().contains("unknown unit"));
        assert!(p("GiB").is_err());
        assert!(p("1e30TiB").is_err());
        assert!(p("99999999999999999999TiB").unwrap_err().contains("too large"));
    }

    #[test]
    fn sizes_print_in_the_largest_binary_unit() {
        assert_eq!(ByteSize(3 << 30).to_string(), "3.00 GiB");
        assert_eq!(ByteSize(5 << 19).to_string(), "2.5 MiB");
        assert_eq!(ByteSize(17).to_string(), "17 B");
    }
}
