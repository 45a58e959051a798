//! Placements of the qwen3_moe parity fixture under GPU budgets from roomy to too small: every
//! expert resident, caches of expert slots with the rest in host memory or on disk, and the
//! error that names the smallest budget.

use kestrel_core::DType;
use kestrel_engine::{Model, ModelSource, Placement, RunShape};

fn model() -> Model {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity/qwen3_moe");
    Model::open(&ModelSource::Dir(dir)).unwrap()
}

const SHAPE: RunShape = RunShape {
    ctx: 64,
    cache_dtype: DType::F32,
    quant: None,
    prefill_chunk: 16,
    pool: None,
};

#[test]
fn a_roomy_budget_keeps_every_expert_resident() {
    let m = model();
    let p = Placement::plan(&m.config, &m.weights, SHAPE, u64::MAX / 2, None).unwrap();
    assert!(p.resident());
    let moe = m.config.moe.as_ref().unwrap();
    assert_eq!(p.experts_per_layer, moe.experts);
    assert_eq!(p.top_k, moe.experts_per_token);
    assert_eq!(p.moe_layers, m.config.moe_layers());
    assert_eq!(
        p.expert_bytes,
        (p.moe_layers * p.experts_per_layer) as u64 * p.expert_span
    );
    assert_eq!(p.uniform_bytes_per_token, 0.0);
    // Exactly enough for everything is still resident.
    let exact = p.resident_bytes + p.expert_bytes;
    assert!(Placement::plan(&m.config, &m.weights, SHAPE, exact, None)
        .unwrap()
        .resident());
}

#[test]
fn a_smaller_budget_caches_what_fits_and_streams_the_rest() {
    let m = model();
    let full = Placement::plan(&m.config, &m.weights, SHAPE, u64::MAX / 2, None).unwrap();
    let total = full.moe_layers * full.experts_per_layer;
    // A layer's experts to stage, and 3 slots in each layer's cache (and half a slot more).
    let per_layer = 3;
    let staging = full.experts_per_layer as u64 * full.expert_span;
    let slots = per_layer * full.moe_layers;
    let budget = full.resident_bytes + staging + slots as u64 * full.expert_span + full.expert_span / 2;
    let p = Placement::plan(&m.config, &m.weights, SHAPE, budget, None).unwrap();
    assert!(!p.resident());
    assert_eq!(
        (p.gpu_experts, p.slots_per_layer, p.staging_bytes),
        (slots, per_layer, staging)
    );
    assert_eq!(
        (p.host_experts, p.disk_experts),
        (total, 0),
        "every layer in host memory"
    );
    let miss = 1.0 - slots as f64 / total as f64;
    let want = (p.moe_layers * p.top_k) as f64 * miss * p.expert_span as f64;
    assert!((p.uniform_bytes_per_token - want).abs() < 1e-6);
    // Host memory for one layer and a bit: one layer there, the others read from disk.
    let layer = p.experts_per_layer as u64 * p.expert_span;
    let h = Placement::plan(&m.config, &m.weights, SHAPE, budget, Some(layer + layer / 2)).unwrap();
    assert_eq!(h.host_layers(Some(layer + layer / 2)), 1);
    assert_eq!(
        (h.host_experts, h.disk_experts),
        (p.experts_per_layer, total - p.experts_per_layer)
    );
}

#[test]
fn a_budget_below_the_staging_and_a_tokens_slots_names_the_minimum() {
    let m = model();
    let full = Placement::plan(&m.config, &m.weights, SHAPE, u64::MAX / 2, None).unwrap();
    let min = full.min_gpu_bytes();
    let p = Placement::plan(&m.config, &m.weights, SHAPE, min, None).unwrap();
    assert_eq!(p.slots_per_layer, full.top_k);
    assert_eq!(p.gpu_experts, full.top_k * full.moe_layers);
    let err = Placement::plan(&m.config, &m.weights, SHAPE, min - 1, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&min.to_string()) && err.contains("slots a layer"),
        "{err}"
    );
    let err = Placement::plan(&m.config, &m.weights, SHAPE, 1000, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("give at least"), "{err}");
}

/// A pool for several sequences gets every sequence's whole context when it fits beside the
/// model, else the blocks the memory left holds (at least one sequence's), and one sequence's
/// when the experts stream anyway.
#[test]
fn a_pool_takes_what_is_left_beside_the_model() {
    use kestrel_engine::KV_BLOCK;
    let m = model();
    let (c, w) = (&m.config, &m.weights);
    let per_seq = SHAPE.ctx.div_ceil(KV_BLOCK);
    let pool = Placement::kv_pool(c, w, SHAPE, 8, 0, u64::MAX / 2).unwrap();
    assert_eq!((pool.seqs, pool.blocks), (8, 8 * per_seq));
    // One sequence's blocks, the model resident: then three blocks more.
    let least = kestrel_model::KvPool {
        seqs: 8,
        blocks: per_seq,
        snapshots: 0,
    };
    let p = Placement::plan(
        c,
        w,
        RunShape {
            pool: Some(least),
            ..SHAPE
        },
        u64::MAX / 2,
        None,
    )
    .unwrap();
    let block = (2 * c.layers * c.kv_heads * c.head_dim * KV_BLOCK * 4) as u64;
    let fits = p.resident_bytes + p.expert_bytes + 3 * block + block / 2;
    let pool = Placement::kv_pool(c, w, SHAPE, 8, 0, fits).unwrap();
    assert_eq!(pool.blocks, per_seq + 3);
    // Less than the experts need: they stream, and the pool keeps one sequence's.
    let streams = (p.min_gpu_bytes() + p.resident_bytes + p.expert_bytes) / 2;
    let pool = Placement::kv_pool(c, w, SHAPE, 8, 0, streams).unwrap();
    assert_eq!(pool.blocks, per_seq);
}

/// A hybrid's state snapshots are resident memory: each holds one sequence's recurrent and
/// convolution states (a model without them has nothing to copy).
#[test]
fn state_snapshots_are_counted_as_resident() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity/qwen3_next");
    let m = Model::open(&ModelSource::Dir(dir)).unwrap();
    let resident = |seqs, snapshots| {
        let pool = kestrel_model::KvPool {
            seqs,
            blocks: 8,
            snapshots,
        };
        let shape = RunShape {
            pool: Some(pool),
            ..SHAPE
        };
        Placement::plan(&m.config, &m.weights, shape, u64::MAX / 2, None)
            .unwrap()
            .resident_bytes
    };
    // One sequence's states: each linear-attention layer's f32 convolution state (the last
    // kernel - 1 inputs of its q, k and v channels) and recurrent state (a dk x dv matrix a head).
    let la = m.config.linear_attn.as_ref().unwrap();
    let layers = (m.config.layer_kinds.iter())
        .filter(|k| **k == kestrel_model::LayerKind::LinearAttention)
        .count();
    let conv =
        (2 * la.key_heads * la.key_head_dim + la.value_heads * la.value_head_dim) * (la.conv_kernel - 1);
    let recurrent = la.value_heads * la.key_head_dim * la.value_head_dim;
    let states = (layers * (conv + recurrent) * 4) as u64;
    assert!(layers > 0 && states > 0);
    assert_eq!(resident(2, 5) - resident(2, 0), 5 * states);
    assert_eq!(resident(2, 1) - resident(2, 0), states);
}

/// The CUDA backend's bf16 copies of the projections it dequantises: counted for the quantised
/// products the dequantised path takes (each attention layer's four projections, the dense MLP's
/// gate and up; not routers, not the dense MLP's down, whose rows of 96 do not divide into
/// groups of 64 and stay bf16, not the experts), none where the path is off or nothing is
/// quantised; and a budget keeps the model resident beside them exactly when it holds both.
#[test]
fn projection_copies_are_counted_and_fit_only_beside_a_resident_model() {
    use kestrel_core::quant::QuantFormat;
    use kestrel_model::{Forward, ForwardSpec};
    let m = model();
    let (c, w) = (&m.config, &m.weights);
    let graph = |quant| {
        let spec = ForwardSpec {
            quant,
            ..ForwardSpec::new(1, SHAPE.ctx, DType::F32)
        };
        Forward::build(c, w, spec).unwrap().graph
    };
    let q4 = graph(Some(QuantFormat::Q4));
    let attention = (c.heads + 2 * c.kv_heads + c.heads) * c.head_dim * c.hidden;
    let dense_mlp = 2 * c.intermediate * c.hidden;
    let lm_head = c.vocab * c.hidden;
    let want = 2 * (c.layers * attention + dense_mlp + lm_head) as u64;
    assert_eq!(kestrel_cuda::projection_copy_bytes(&q4, 33), want);
    assert_eq!(kestrel_cuda::projection_copy_bytes(&q4, 0), 0);
    assert_eq!(kestrel_cuda::projection_copy_bytes(&graph(None), 33), 0);
    let full = Placement::plan(c, w, SHAPE, u64::MAX / 2, None).unwrap();
    let both = full.resident_bytes + full.expert_bytes + want;
    assert!(Placement::resident_beside(c, w, SHAPE, both, want));
    assert!(!Placement::resident_beside(c, w, SHAPE, both - 1, want));
    assert!(!Placement::resident_beside(c, w, SHAPE, want - 1, want));
}
