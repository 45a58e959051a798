//! `kestrel inspect`: what a model directory holds: architecture, layer kinds, parameter counts
//! (total, and active per token for MoE models), weight dtypes and formats, and the memory a
//! run needs at a given context (weights as loaded, optionally quantised on load with `--quant`,
//! KV caches of the full-attention layers, recurrent states of the linear-attention ones, the
//! activations of a decode step and of a prefill chunk, and the bf16 copies of projections the
//! CUDA backend keeps, from the graphs the run would build).

use anyhow::{ensure, Context, Result};
use clap::Args;
use kestrel_core::ir::BufKind;
use kestrel_core::planner::Plan;
use kestrel_core::{Config, DType};
use kestrel_engine::{ByteSize, Model, Placement, RunShape};
use kestrel_model::{footprint, Forward, ForwardSpec, LayerKind, MlpKind, ModelConfig, Weights};

use crate::args::{ModelArgs, QuantArgs};

/// Bytes of what a run of `tokens` tokens holds on the backend, from its graph: weights as
/// loaded (in `quant`'s format when given), KV caches and states, the activations' arena, and
/// the bf16 copies of the projections the CUDA backend dequantises from `dequant_from` tokens
/// (`kestrel_cuda::projection_copy_bytes`; 0: none).
fn run_memory(
    c: &ModelConfig,
    w: &Weights,
    a: &InspectArgs,
    cache: DType,
    (tokens, dequant_from): (usize, usize),
) -> Result<(u64, u64, u64, u64)> {
    // f32 norm outputs (`new`'s): the larger plan (a CUDA prefill stores some of them as bf16).
    let spec = ForwardSpec {
        quant: a.quant.format()?,
        ..ForwardSpec::new(tokens, a.ctx, cache)
    };
    let f = Forward::build(c, w, spec)?;
    let of = |kind: BufKind| -> u64 {
        f.graph
            .bufs
            .iter()
            .filter(|d| d.kind == kind)
            .map(|d| d.byte_len() as u64)
            .sum()
    };
    Ok((
        of(BufKind::Weight),
        of(BufKind::State),
        Plan::new(&f.graph).arena_bytes as u64,
        kestrel_cuda::projection_copy_bytes(&f.graph, dequant_from),
    ))
}

#[derive(Args)]
pub struct InspectArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Context the memory estimate is for.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// KV cache element type of the estimate: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    cache: String,
    /// Prompt chunk the prefill estimate is for.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    #[command(flatten)]
    quant: QuantArgs,
    /// Also plan where the bytes go on a GPU with this much memory (e.g. 16GiB): resident
    /// weights, a cache of experts, the rest streamed.
    #[arg(long)]
    gpu_mem: Option<ByteSize>,
    /// Host memory for the experts the GPU does not hold (e.g. 64GiB; default: no limit); the
    /// rest would stream from disk.
    #[arg(long, requires = "gpu_mem")]
    host_mem: Option<ByteSize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(config: &Config, a: InspectArgs) -> Result<std::process::ExitCode> {
    let Model {
        config: c,
        weights: w,
        ..
    } = Model::open(&a.model.source())?;
    let cache = match a.cache.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        other => anyhow::bail!("--cache {other}: expected bf16, f16 or f32"),
    };
    let fp = footprint(&c, &w)?;
    let (total, active, formats) = (fp.params, fp.active_params, &fp.formats);
    let full = c
        .layer_kinds
        .iter()
        .filter(|&&k| k == LayerKind::FullAttention)
        .count();
    let linear = c.layers - full;
    // Checked: a context the address space cannot hold is an error, not a saturated figure.
    let kv_bytes = [full, c.kv_heads, a.ctx, c.head_dim, cache.size_in_bytes()]
        .into_iter()
        .try_fold(2u64, |acc, n| acc.checked_mul(n as u64))
        .filter(|&b| usize::try_from(b).is_ok())
        .with_context(|| {
            format!(
                "--ctx {}: the KV cache would need more bytes than this machine can address",
                a.ctx
            )
        })?;
    let state_bytes = c.linear_attn.as_ref().map_or(0, |l| {
        let conv =
            (2 * l.key_heads * l.key_head_dim + l.value_heads * l.value_head_dim) * (l.conv_kernel - 1);
        (linear * (l.value_heads * l.key_head_dim * l.value_head_dim + conv) * 4) as u64
    });
    // On disk: the tensors' bytes as stored, or a GGUF file's own size (its quantised tensors
    // are held dequantised, so what is loaded is more).
    let weight_bytes = match a.model.source() {
        kestrel_engine::ModelSource::Dir(p) if p.is_file() => w.file_bytes(),
        _ => fp.bytes,
    };
    ensure!(
        a.ctx >= 1 && a.prefill_chunk >= 1,
        "--ctx and --prefill-chunk must be at least 1"
    );
    // The CUDA backend's copies, as the configuration would have them (`KESTREL_PROJECTION_COPIES`).
    let dequant_from = match config.projection_copies {
        true => config.dequant_projections_from,
        false => 0,
    };
    let (loaded, persistent, decode_arena, copies) = run_memory(&c, &w, &a, cache, (1, dequant_from))?;
    let chunk = a.prefill_chunk.min(a.ctx);
    let (_, _, prefill_arena, _) = run_memory(&c, &w, &a, cache, (chunk, 0))?;
    let moe_layers = c.mlp_kinds.iter().filter(|&&k| k == MlpKind::Moe).count();
    let placement = match a.gpu_mem {
        Some(gpu) => {
            let shape = RunShape {
                ctx: a.ctx,
                cache_dtype: cache,
                quant: a.quant.format()?,
                prefill_chunk: chunk,
                pool: None,
            };
            Some(Placement::plan(&c, &w, shape, gpu.0, a.host_mem.map(|h| h.0))?)
        }
        None => None,
    };
    let size = |b: u64| match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.1} KiB", b as f64 / 1024.0),
    };
    if a.json {
        let v = serde_json::json!({
            "architecture": c.arch.model_type(),
            "layers": c.layers,
            "full_attention_layers": full,
            "linear_attention_layers": linear,
            "moe_layers": moe_layers,
            "parameters": total,
            "active_parameters_per_token": active,
            "formats": formats,
            "weight_bytes": weight_bytes,
            "active_bytes_per_token": fp.active_bytes,
            "ctx": a.ctx,
            "kv_cache_bytes": kv_bytes,
            "recurrent_state_bytes": state_bytes,
            "quant": a.quant.format()?.map(|f| format!("q{} (groups of {})", f.bits, f.group_size)),
            "loaded_weight_bytes": loaded,
            "cache_and_state_bytes": persistent,
            "decode_activation_bytes": decode_arena,
            "prefill_chunk": chunk,
            "prefill_activation_bytes": prefill_arena,
            "projection_copy_bytes": copies,
            "placement": placement.as_ref().map(|p| serde_json::json!({
                "gpu_bytes": a.gpu_mem.map(|g| g.0),
                "host_bytes": a.host_mem.map(|h| h.0),
                "resident_bytes": p.resident_bytes,
                "expert_bytes": p.expert_bytes,
                "expert_span_bytes": p.expert_span,
                "gpu_experts": p.gpu_experts,
                "slots_per_layer": p.slots_per_layer,
                "staging_bytes": p.staging_bytes,
                "stage_ahead": p.stage_ahead,
                "host_experts": p.host_experts,
                "disk_experts": p.disk_experts,
                "streams": !p.resident(),
                "min_gpu_bytes": p.min_gpu_bytes(),
                "uniform_bytes_per_token": p.uniform_bytes_per_token,
            })),
        });
        outln!("{v}")?;
        return Ok(std::process::ExitCode::SUCCESS);
    }
    outln!("architecture      {}", c.arch.model_type())?;
    outln!(
        "layers            {} ({full} full attention, {linear} linear attention; {moe_layers} MoE)",
        c.layers
    )?;
    outln!(
        "sizes             hidden {}, heads {}/{} of {}, vocab {}",
        c.hidden,
        c.heads,
        c.kv_heads,
        c.head_dim,
        c.vocab
    )?;
    if let Some(m) = &c.moe {
        outln!(
            "experts           {} of {} per token, width {}{}",
            m.experts_per_token,
            m.experts,
            m.expert_intermediate,
            m.shared_intermediate
                .map_or(String::new(), |s| format!(", shared expert {s}"))
        )?;
    }
    outln!("parameters        {total} total, {active} active per token")?;
    let h200 = kestrel_cuda::ceilings::H200;
    outln!(
        "bytes per token   {} read by a decode step (floor {:.0} tokens/s on an H200, {:.2} TB/s)",
        size(fp.active_bytes),
        h200.copy_bytes_per_s / fp.active_bytes.max(1) as f64,
        h200.copy_bytes_per_s / 1e12
    )?;
    let fmts: Vec<String> = formats.iter().map(|(f, n)| format!("{f}: {n}")).collect();
    outln!("formats           {}", fmts.join(", "))?;
    outln!(
        "memory at ctx {}  weights {} as loaded{} ({} on disk), KV cache ({cache}) {}, recurrent state {}",
        a.ctx,
        size(loaded),
        a.quant
            .format()?
            .map_or(String::new(), |f| format!(" at {} bits", f.bits)),
        size(weight_bytes),
        size(kv_bytes),
        size(state_bytes)
    )?;
    outln!(
        "activations       {} for a decode step, {} for a {chunk}-token prefill chunk",
        size(decode_arena),
        size(prefill_arena)
    )?;
    if copies > 0 {
        outln!(
            "projection copies {} on CUDA: the quantised projections as bf16, for products of {dequant_from} or more tokens (kept where the model stays resident beside them; KESTREL_PROJECTION_COPIES=off saves them)",
            size(copies)
        )?;
    }
    if let (Some(p), Some(gpu)) = (&placement, a.gpu_mem) {
        let total = p.moe_layers * p.experts_per_layer;
        if p.resident() {
            outln!(
                "placement         everything fits in {gpu}: {} resident, {} of experts",
                size(p.resident_bytes),
                size(p.expert_bytes)
            )?;
        } else {
            outln!(
                "placement         {gpu} of GPU: {} resident (weights {}, caches, activations), caches of {} of the {total} experts ({:.0}%: {} slots in each of {} layers, {} each), {} to stage long prompts' layers{}; streamed from host memory for {} experts, from disk for {}",
                size(p.resident_bytes),
                size(p.resident_weight_bytes),
                p.gpu_experts,
                100.0 * p.gpu_experts as f64 / total as f64,
                p.slots_per_layer,
                p.moe_layers,
                size(p.expert_span),
                size(p.staging_bytes),
                if p.stage_ahead {
                    " (two: when a long prompt uses most of a layer's experts, whole layers are staged ahead)"
                } else {
                    ""
                },
                p.host_experts,
                p.disk_experts
            )?;
            let routed = p.moe_layers * p.top_k;
            let missed = routed as f64 * (1.0 - p.gpu_experts as f64 / total as f64);
            outln!(
                "streamed          {} a decode token if routing were uniform ({missed:.1} of {routed} routed experts miss); the smallest GPU budget is {}",
                size(p.uniform_bytes_per_token as u64),
                ByteSize(p.min_gpu_bytes())
            )?;
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
