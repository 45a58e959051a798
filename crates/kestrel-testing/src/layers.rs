//! Whole decoder layers of each supported kind, built as graphs with random weights: a prefill
//! of several tokens followed by single-token decode steps that reuse the weights, KV caches and
//! recurrent states by label. Used to check that backends agree on complete layers.

use kestrel_core::ir::*;
use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_core::rope::{RopeScaling, RopeTable};
use kestrel_core::DType;

use crate::cases::{random_experts, Case, CaseBuilder};

/// Label of a layer case's output buffer.
pub const OUTPUT: &str = "layer_out";
/// Label of the selected experts of a MoE layer case.
pub const ROUTED: &str = "topk.ids";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Qwen3-MoE: standard norms, q/k norm, full attention, routed experts.
    Qwen3Moe,
    /// Qwen3-Next full attention: zero-centred norms, gated queries, partial rotary, shared expert.
    NextAttention,
    /// Qwen3-Next linear attention: Gated DeltaNet, shared expert.
    NextLinear,
}

/// Small but structurally faithful dimensions.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub moe_inter: usize,
    pub shared_inter: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub max_ctx: usize,
    pub quant: Option<QuantFormat>,
}

impl Dims {
    pub fn small(quant: Option<QuantFormat>) -> Dims {
        Dims {
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            experts: 8,
            top_k: 2,
            moe_inter: 64,
            shared_inter: 128,
            k_heads: 2,
            v_heads: 4,
            k_dim: 32,
            v_dim: 32,
            max_ctx: 40,
            quant,
        }
    }
}

struct Layer<'a> {
    c: &'a mut CaseBuilder,
    d: Dims,
    zc: NormKind,
}

impl Layer<'_> {
    fn linear_w(&mut self, label: &str, rows: usize, cols: usize) -> LinearWeight {
        self.c
            .linear_weight(label, rows, cols, self.d.quant, DType::BF16)
            .0
    }

    fn norm_w(&mut self, label: &str, dim: usize) -> BufId<Weight> {
        // Zero-centred weights sit around 0, standard ones around 1.
        let offset = if self.zc == NormKind::ZeroCentered {
            0.0
        } else {
            1.0
        };
        let v: Vec<f32> = self.c.randn(dim, 0.1).iter().map(|x| x + offset).collect();
        self.c.weight_from(label, DType::BF16, &[dim], &v).0
    }

    fn attention(&mut self, h: BufId<Normed>, pos: BufId<Positions>, gated: bool) -> BufId<Act> {
        let Dims {
            hidden,
            heads,
            kv_heads,
            head_dim: hd,
            max_ctx,
            ..
        } = self.d;
        let q_rows = if gated { 2 * heads * hd } else { heads * hd };
        let (qw, kw, vw) = (
            self.linear_w("attn.q", q_rows, hidden),
            self.linear_w("attn.k", kv_heads * hd, hidden),
            self.linear_w("attn.v", kv_heads * hd, hidden),
        );
        let ow = self.linear_w("attn.o", hidden, heads * hd);
        let (qn, kn) = (self.norm_w("attn.q_norm", hd), self.norm_w("attn.k_norm", hd));
        let qg = self.c.g.linear("q_proj", h, &qw);
        let (q, gate) = if gated {
            let parts = self.c.g.split("q_gate", qg, heads, &[hd, hd]);
            (parts[0], Some(parts[1]))
        } else {
            (qg, None)
        };
        let k = self.c.g.linear("k_proj", h, &kw);
        let v = self.c.g.linear("v_proj", h, &vw);
        let q = self.c.g.head_norm("q_norm", q, qn, hd, 1e-6, self.zc);
        let k = self.c.g.head_norm("k_norm", k, kn, hd, 1e-6, self.zc);
        let partial = if gated { 0.25 } else { 1.0 };
        let table = RopeTable::new(1e6, hd, partial, &RopeScaling::None);
        let freq = self
            .c
            .weight_from("rope.inv_freq", DType::F32, &[table.rot_dim / 2], &table.inv_freq)
            .0;
        self.c
            .g
            .rope("rope_q", q, pos, freq, heads, hd, table.rot_dim, 1.0);
        self.c
            .g
            .rope("rope_k", k, pos, freq, kv_heads, hd, table.rot_dim, 1.0);
        // One sequence in blocks of 4 rows, its blocks in reverse order.
        let blocks = max_ctx.div_ceil(4);
        let order: Vec<u32> = (0..blocks as u32).rev().collect();
        let table = self.c.g.page_table_input("kv.table", 1, blocks);
        self.c.set(table, bytemuck::cast_slice(&order).to_vec());
        let seq = self.c.g.seq_input("kv.seq", 1);
        self.c.set(seq, vec![0; 4]);
        let pages = self.c.g.kv_pages("kv.pages", table, seq, 4);
        let kc = self
            .c
            .g
            .cache("attn.k_cache", DType::BF16, kv_heads, 4 * blocks, hd);
        let vc = self
            .c
            .g
            .cache("attn.v_cache", DType::BF16, kv_heads, 4 * blocks, hd);
        self.c.g.kv_append("kv_append", k, v, pos, kc, vc, pages);
        let mut a = self.c.g.attention(
            "attention",
            q,
            kc,
            vc,
            pos,
            pages,
            heads,
            1.0 / (hd as f32).sqrt(),
        );
        if let Some(gate) = gate {
            a = self.c.g.sigmoid_gate("attn_gate", a, gate);
        }
        self.c.check_state(kc);
        self.c.g.linear("o_proj", a, &ow)
    }

    fn linear_attention(&mut self, h: BufId<Normed>) -> BufId<Act> {
        let Dims {
            hidden,
            k_heads: nk,
            v_heads: nv,
            k_dim: dk,
            v_dim: dv,
            ..
        } = self.d;
        let r = nv / nk;
        let (key_dim, value_dim) = (nk * dk, nv * dv);
        let qkvz_w = self.linear_w("la.in_proj_qkvz", 2 * key_dim + 2 * value_dim, hidden);
        let ba_w = self.linear_w("la.in_proj_ba", 2 * nv, hidden);
        let out_w = self.linear_w("la.out_proj", hidden, value_dim);
        let conv_dim = 2 * key_dim + value_dim;
        let conv_w = self.c.weight("la.conv1d", DType::BF16, &[conv_dim, 4], 0.5).0;
        let a_log_v: Vec<f32> = (0..nv)
            .map(|_| (0.5 + 4.0 * self.c.rng.next_f32()).ln())
            .collect();
        let a_log = self.c.weight_from("la.A_log", DType::F32, &[nv], &a_log_v).0;
        let dt = self.c.weight("la.dt_bias", DType::BF16, &[nv], 1.0).0;
        let norm = self.c.weight("la.norm", DType::F32, &[dv], 0.1).0;
        let conv_state = self.c.state("la.conv_state", &[conv_dim, 3], 0.0).0;
        let state = self.c.state("la.state", &[nv, dk, dv], 0.0).0;

        let qkvz = self.c.g.linear("in_proj_qkvz", h, &qkvz_w);
        let ba = self.c.g.linear("in_proj_ba", h, &ba_w);
        let p = self.c.g.split("qkvz", qkvz, nk, &[dk, dk, r * dv, r * dv]);
        let bap = self.c.g.split("ba", ba, nk, &[r, r]);
        let mixed = self.c.g.concat("mixed_qkv", &[p[0], p[1], p[2]]);
        let conv = self.c.g.causal_conv1d("conv1d", mixed, conv_w, conv_state, None);
        let qkv = self.c.g.split("qkv", conv, 1, &[key_dim, key_dim, value_dim]);
        let (g, beta) = self.c.g.delta_gates("gates", bap[1], bap[0], a_log, dt);
        let o = self.c.g.delta_rule(
            "delta_rule",
            qkv[0],
            qkv[1],
            qkv[2],
            g,
            beta,
            state,
            None,
            nk,
            dk,
            nv,
            dv,
            DeltaAlgo::Auto,
        );
        let o = self.c.g.gated_rms_norm("norm", o, p[3], norm, dv, 1e-6);
        self.c.check_state(state);
        self.c.check_state(conv_state);
        self.c.g.linear("out_proj", o, &out_w)
    }

    fn moe(&mut self, h: BufId<Normed>, shared: bool) -> BufId<Act> {
        let Dims {
            hidden,
            experts,
            top_k,
            moe_inter,
            shared_inter,
            quant,
            ..
        } = self.d;
        let router_w = self
            .c
            .linear_weight(
                "moe.router",
                experts,
                hidden,
                quant.map(|_| QuantFormat::Q8),
                DType::BF16,
            )
            .0;
        let format = match quant {
            Some(q) => ExpertFormat::Quant(q),
            None => ExpertFormat::Bf16,
        };
        let layout = ExpertLayout::uniform(experts, hidden, moe_inter, format);
        let (blob, _) = random_experts(self.c, &layout);
        let eb = self.c.g.weight("moe.experts", DType::U8, [layout.total_bytes()]);
        self.c.set(eb, blob);
        let logits = self.c.g.linear("router", h, &router_w);
        let (ids, w) = self.c.g.router("topk", logits, top_k, true);
        // Compared across backends, so a test can tell a routing flip (a near tie decided the
        // other way after rounding upstream) from an error.
        self.c.check_backends(ids);
        let mut out = self.c.g.moe_experts("experts", h, ids, w, eb, layout);
        if shared {
            let (gw, uw) = (
                self.linear_w("moe.shared.gate", shared_inter, hidden),
                self.linear_w("moe.shared.up", shared_inter, hidden),
            );
            let dw = self.linear_w("moe.shared.down", hidden, shared_inter);
            let sgw = self
                .c
                .linear_weight("moe.shared_gate", 1, hidden, None, DType::BF16)
                .0;
            let g = self.c.g.linear("shared.gate", h, &gw);
            let u = self.c.g.linear("shared.up", h, &uw);
            let a = self.c.g.swiglu("shared.act", g, u);
            let s = self.c.g.linear("shared.down", a, &dw);
            let sg = self.c.g.linear("shared_gate", h, &sgw);
            let s = self.c.g.sigmoid_gate("shared.gated", s, sg);
            out = self.c.g.add("moe.sum", out, s);
        }
        out
    }
}

/// One layer over the rows of `x` (`[tokens, hidden]`) at positions `past..`. Weights come from
/// `weight_seed` (the same seed, the same weights); `upload` writes weights and states.
pub fn layer_case(
    kind: LayerKind,
    dims: Dims,
    weight_seed: u64,
    x: &[f32],
    past: usize,
    upload: bool,
) -> Case {
    let tokens = x.len() / dims.hidden;
    let mut c = CaseBuilder::new(Rng::new(weight_seed));
    c.upload_persistent = upload;
    // Attention over the bf16 caches runs on tensor cores on CUDA, with queries and
    // probabilities rounded to bf16.
    c.rounded_activations = dims.quant.is_some() || kind != LayerKind::NextLinear;
    let zc = if kind == LayerKind::Qwen3Moe {
        NormKind::Standard
    } else {
        NormKind::ZeroCentered
    };
    let xb = c.g.residual_input("x", tokens, dims.hidden);
    c.set(xb, bytemuck::cast_slice(x).to_vec());
    let x = xb;
    let pos: Vec<u32> = (past..past + tokens).map(|p| p as u32).collect();
    let pos = c.positions("pos", &pos);
    let mut l = Layer {
        c: &mut c,
        d: dims,
        zc,
    };
    let in_ln = l.norm_w("input_layernorm", dims.hidden);
    let post_ln = l.norm_w("post_attention_layernorm", dims.hidden);
    let h = l.c.g.rms_norm("input_layernorm", x, in_ln, 1e-6, zc);
    let mixed = match kind {
        LayerKind::Qwen3Moe => l.attention(h, pos, false),
        LayerKind::NextAttention => l.attention(h, pos, true),
        LayerKind::NextLinear => l.linear_attention(h),
    };
    let h2 =
        l.c.g
            .add_rms_norm("post_attention_layernorm", x, mixed, post_ln, 1e-6, zc);
    let m = l.moe(h2, kind != LayerKind::Qwen3Moe);
    let out = l.c.g.add_residual(OUTPUT, x, m);
    c.check_backends(out);
    c.finish(format!(
        "{kind:?} layer t{tokens} at {past} quant {:?}",
        dims.quant
    ))
}

/// The same layer over the rows of `x` as a prefill of `prefill` rows followed by one decode
/// step per remaining row, all sharing weights, caches and states by label.
pub fn layer_sequence(kind: LayerKind, dims: Dims, weight_seed: u64, x: &[f32], prefill: usize) -> Vec<Case> {
    let h = dims.hidden;
    let tokens = x.len() / h;
    let mut steps = vec![layer_case(kind, dims, weight_seed, &x[..prefill * h], 0, true)];
    for t in prefill..tokens {
        steps.push(layer_case(
            kind,
            dims,
            weight_seed,
            &x[t * h..(t + 1) * h],
            t,
            false,
        ));
    }
    steps
}
