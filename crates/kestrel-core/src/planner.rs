//! The memory planner: where every buffer of a graph lives.
//!
//! Transient buffers live from the first node that touches them to the last (to the node after
//! it when a backend may run the two as one kernel: `Op::may_join`); two transients whose
//! intervals do not overlap may share bytes. Placement is a deterministic greedy
//! colouring: largest first (ties by first use, then index), each at the lowest offset that does
//! not collide with an already placed buffer live at the same time. Weights, states, inputs and
//! outputs are never aliased. Both backends use the same plan.

use crate::ir::{BufKind, Graph};

/// Alignment of every arena offset (and the arena itself), in bytes.
pub const ALIGN: usize = 256;

/// Where one buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Weight or state: its own storage, shared by label across graphs.
    Persistent,
    /// Input or output: its own storage for this graph.
    Dedicated,
    /// A transient at `offset` in the graph's arena.
    Arena { offset: usize },
    /// Declared but never touched by a node: no storage.
    Unused,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub slots: Vec<Slot>,
    /// Live interval `[first, last]` node of each transient (None for the others).
    pub intervals: Vec<Option<(usize, usize)>>,
    /// Bytes of the transient arena.
    pub arena_bytes: usize,
    /// Bytes the transients would take without sharing (each rounded up to the alignment).
    pub naive_bytes: usize,
}

fn aligned(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

impl Plan {
    pub fn new(graph: &Graph) -> Plan {
        let n = graph.bufs.len();
        let mut intervals: Vec<Option<(usize, usize)>> = vec![None; n];
        for (i, (reads, writes)) in graph.io().into_iter().enumerate() {
            // A node a backend may run as one kernel with the next (`Op::may_join`) keeps its
            // buffers live through the next.
            let last = match graph.nodes.get(i + 1) {
                Some(next) if graph.nodes[i].op.may_join(&next.op) => i + 1,
                _ => i,
            };
            for b in reads.into_iter().chain(writes) {
                let iv = &mut intervals[b.index()];
                *iv = Some(match *iv {
                    None => (i, last),
                    Some((first, l)) => (first, l.max(last)),
                });
            }
        }
        let mut slots = vec![Slot::Unused; n];
        let mut sizes = vec![0usize; n];
        for (i, d) in graph.bufs.iter().enumerate() {
            slots[i] = match d.kind {
                BufKind::Weight | BufKind::HostWeight | BufKind::State => Slot::Persistent,
                BufKind::Input | BufKind::Output => Slot::Dedicated,
                BufKind::Transient if intervals[i].is_some() => {
                    sizes[i] = aligned(d.byte_len().max(1));
                    Slot::Arena { offset: 0 }
                }
                BufKind::Transient => Slot::Unused,
            };
            if d.kind != BufKind::Transient {
                intervals[i] = None;
            }
        }
        let live: Vec<usize> = (0..n)
            .filter(|&i| matches!(slots[i], Slot::Arena { .. }))
            .collect();
        let items: Vec<(usize, (usize, usize))> = live
            .iter()
            .map(|&i| (sizes[i], intervals[i].expect("live")))
            .collect();
        let offsets = place(&items);
        for (&i, &off) in live.iter().zip(&offsets) {
            slots[i] = Slot::Arena { offset: off };
        }
        let arena_bytes = live
            .iter()
            .zip(&offsets)
            .map(|(&i, &o)| o + sizes[i])
            .max()
            .unwrap_or(0);
        Plan {
            slots,
            intervals,
            arena_bytes,
            naive_bytes: sizes.iter().sum(),
        }
    }
}

/// Places `(size, [first, last])` items; returns their offsets. Deterministic.
pub fn place(items: &[(usize, (usize, usize))]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(items[i].0), items[i].1 .0, i));
    let mut offsets = vec![0usize; items.len()];
    let mut placed: Vec<usize> = Vec::new();
    for &i in &order {
        let (size, (first, last)) = items[i];
        // Address ranges of placed items live at the same time as item i, by start.
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| {
                let (f, l) = items[j].1;
                f <= last && first <= l
            })
            .map(|&j| (offsets[j], offsets[j] + items[j].0))
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (start, end) in busy {
            if offset + size <= start {
                break;
            }
            offset = offset.max(end);
        }
        offsets[i] = offset;
        placed.push(i);
    }
    offsets
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{LinearWeight, NormKind, JOIN_MAX_TOKENS};
    use crate::rng::Rng;
    use crate::{DType, GraphBuilder};

    #[test]
    fn random_intervals_never_share_live_bytes_and_plans_are_deterministic() {
        let (mut rng, seed) = Rng::from_time();
        for round in 0..300 {
            let n = rng.range(1, 60);
            let items: Vec<(usize, (usize, usize))> = (0..n)
                .map(|_| {
                    let a = rng.range(0, 40);
                    let b = a + rng.range(0, 10);
                    (ALIGN * rng.range(1, 20), (a, b))
                })
                .collect();
            let offs = place(&items);
            assert_eq!(
                offs,
                place(&items),
                "seed {seed} round {round}: not deterministic"
            );
            for i in 0..n {
                assert_eq!(offs[i] % ALIGN, 0);
                for j in 0..i {
                    let time = items[i].1 .0 <= items[j].1 .1 && items[j].1 .0 <= items[i].1 .1;
                    let space = offs[i] < offs[j] + items[j].0 && offs[j] < offs[i] + items[i].0;
                    assert!(
                        !(time && space),
                        "seed {seed} round {round}: {i} and {j} share live bytes"
                    );
                }
            }
            let peak: usize = (0..50)
                .map(|t| {
                    items
                        .iter()
                        .filter(|it| it.1 .0 <= t && t <= it.1 .1)
                        .map(|it| it.0)
                        .sum()
                })
                .max()
                .unwrap_or(0);
            let total = offs.iter().zip(&items).map(|(o, it)| o + it.0).max().unwrap_or(0);
            assert!(
                total >= peak,
                "an arena can never be smaller than the peak live bytes"
            );
        }
    }

    /// A chain of norms and projections: transients alias, persistents and I/O never do.
    #[test]
    fn graph_plan_aliases_only_transients() {
        let mut g = GraphBuilder::new();
        let x = g.residual_input("x", 3, 64);
        let nw = g.weight("norm", DType::F32, [64]);
        let w = LinearWeight::Dense(g.weight("w", DType::BF16, [64, 64]));
        let mut h = g.rms_norm("n0", x, nw, 1e-6, NormKind::Standard);
        let mut outs = Vec::new();
        for i in 0..6 {
            let y = g.linear(&format!("p{i}"), h, &w);
            outs.push(y);
            let r = g.add_residual("res", x, y);
            h = g.rms_norm(&format!("n{}", i + 1), r, nw, 1e-6, NormKind::Standard);
        }
        let y = g.linear("last", h, &w);
        g.mark_output(y);
        let graph = g.finish().unwrap();
        let plan = Plan::new(&graph);
        assert_eq!(plan, Plan::new(&graph), "deterministic");
        assert!(
            plan.arena_bytes < plan.naive_bytes,
            "{} vs {}",
            plan.arena_bytes,
            plan.naive_bytes
        );
        for (i, d) in graph.bufs.iter().enumerate() {
            match d.kind {
                BufKind::Weight | BufKind::HostWeight | BufKind::State => {
                    assert_eq!(plan.slots[i], Slot::Persistent)
                }
                BufKind::Input | BufKind::Output => assert_eq!(plan.slots[i], Slot::Dedicated),
                BufKind::Transient => assert!(matches!(plan.slots[i], Slot::Arena { .. })),
            }
        }
    }
    /// A few tokens' norm and the product reading it may run as one kernel: the norm's input
    /// stays live through the product, so the product's output never shares its bytes. With
    /// more tokens the intervals end where the nodes do.
    #[test]
    fn a_joinable_pair_keeps_the_first_nodes_buffers_live_through_the_second() {
        for tokens in [1, 2, JOIN_MAX_TOKENS, JOIN_MAX_TOKENS + 1] {
            let mut g = GraphBuilder::new();
            let x = g.act_input("x", tokens, 64);
            let w = LinearWeight::Dense(g.weight("w", DType::BF16, [64, 64]));
            let nw = g.weight("norm", DType::F32, [64]);
            let a = g.linear("a", x, &w);
            let n = g.rms_norm("n", a, nw, 1e-6, NormKind::Standard);
            let b = g.linear("b", n, &w);
            let c = g.linear("c", b, &w);
            g.mark_output(c);
            let graph = g.finish().unwrap();
            let plan = Plan::new(&graph);
            let (a, b) = (a.raw().index(), b.raw().index());
            let (a_last, b_first) = (plan.intervals[a].unwrap().1, plan.intervals[b].unwrap().0);
            let joined = graph.nodes[1].op.may_join(&graph.nodes[2].op);
            assert_eq!(joined, tokens <= JOIN_MAX_TOKENS);
            assert_eq!(a_last, if joined { b_first } else { b_first - 1 });
            if joined {
                assert_ne!(plan.slots[a], plan.slots[b], "a and b share bytes");
            }
        }
    }

    /// One token's attention inputs join only the attention that reads their queries over the
    /// same caches, positions and pages (a backend runs the two as one kernel); an attention of
    /// other caches or positions, or of two tokens, does not.
    #[test]
    fn attention_inputs_join_only_the_attention_that_reads_them() {
        let (kv_heads, heads, hd, rows) = (2, 4, 16, 64);
        let build = |tokens: usize, other_caches: bool, other_positions: bool| {
            let mut g = GraphBuilder::new();
            let qkv = g.act_input("qkv", tokens, (heads + 2 * kv_heads) * hd);
            let pos = g.positions_input("pos", tokens);
            let inv_freq = g.weight("inv_freq", DType::F32, [hd / 2]);
            let cache = |g: &mut GraphBuilder, name: &str| g.cache(name, DType::BF16, kv_heads, rows, hd);
            let (kc, vc) = (cache(&mut g, "k"), cache(&mut g, "v"));
            let table = g.page_table_input("table", 1, rows / 16);
            let seq = g.seq_input("seq", 1);
            let pages = g.kv_pages("pages", table, seq, 16);
            let (q, _) =
                g.attention_inputs("inputs", qkv, false, None, pos, inv_freq, hd, 1.0, kc, vc, pages);
            let (kc, vc) = match other_caches {
                true => (cache(&mut g, "k2"), cache(&mut g, "v2")),
                false => (kc, vc),
            };
            let pos = match other_positions {
                true => g.positions_input("pos2", tokens),
                false => pos,
            };
            let out = g.attention("attention", q, kc, vc, pos, pages, heads, 0.25);
            g.mark_output(out);
            let graph = g.finish().unwrap();
            let n = graph.nodes.len();
            graph.nodes[n - 2].op.may_join(&graph.nodes[n - 1].op)
        };
        assert!(build(1, false, false));
        assert!(!build(1, true, false));
        assert!(!build(1, false, true));
        assert!(!build(2, false, false));
    }
}
