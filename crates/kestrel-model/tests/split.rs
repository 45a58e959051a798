//! A forward graph cut into segments that run one after another as separate programs (what a
//! run that streams experts does, acting between a router and its experts) computes exactly
//! what the whole graph computes: the same logits bit for bit on the CPU backend, for every
//! fixture, cut before each MoE experts node and at random places, in prefill and decode.

mod common;

use common::{dir, reference, FIXTURES};
use kestrel_core::ir::{BufKind, Op};
use kestrel_core::rng::Rng;
use kestrel_core::{Backend, DType};
use kestrel_cpu::CpuBackend;
use kestrel_model::{Forward, ForwardSpec, ModelConfig, Weights};

fn spec(tokens: usize, past: usize) -> ForwardSpec {
    ForwardSpec {
        past,
        all_logits: true,
        ..ForwardSpec::new(tokens, 64, DType::F32)
    }
}

/// Runs a prompt, then one decode token, through `cuts` segments of each program on a fresh
/// backend; returns the two steps' logits.
fn run(c: &ModelConfig, w: &Weights, tokens: &[u32], cuts: &dyn Fn(&Forward) -> Vec<usize>) -> Vec<f32> {
    let mut cpu = CpuBackend::new();
    let mut out = Vec::new();
    let steps: [(&[u32], usize); 2] = [
        (&tokens[..tokens.len() - 1], 0),
        (&tokens[tokens.len() - 1..], tokens.len() - 1),
    ];
    for (i, (ids, past)) in steps.into_iter().enumerate() {
        let f = Forward::build(c, w, spec(ids.len(), past)).unwrap();
        let segments = f.graph.split(&cuts(&f));
        let mut programs: Vec<_> = segments.iter().map(|g| cpu.prepare(g).unwrap()).collect();
        if i == 0 {
            f.upload(w, &mut cpu, &mut programs[0]).unwrap();
        }
        let pos: Vec<u32> = (past..past + ids.len()).map(|p| p as u32).collect();
        for (g, p) in segments.iter().zip(&mut programs) {
            // Each segment gets the inputs it reads.
            if g.decl(f.tokens).kind == BufKind::Input {
                cpu.upload(p, f.tokens, ids).unwrap();
            }
            if g.decl(f.positions).kind == BufKind::Input {
                cpu.upload(p, f.positions, &pos).unwrap();
            }
            f.write_pages(&mut cpu, p).unwrap();
            cpu.run(p).unwrap();
        }
        let last = programs.last().unwrap();
        out.extend(cpu.download::<f32>(last, f.logits).unwrap());
    }
    out
}

#[test]
fn segments_compute_what_the_whole_graph_computes() {
    for name in FIXTURES {
        let c = ModelConfig::from_dir(&dir(name)).unwrap();
        let w = Weights::open(&dir(name)).unwrap();
        let (tokens, _, _) = reference(name);
        let whole = run(&c, &w, &tokens, &|_| Vec::new());
        let before_experts = |f: &Forward| -> Vec<usize> {
            (f.graph.nodes.iter().enumerate())
                .filter(|(_, n)| matches!(n.op, Op::MoeExperts { .. }))
                .map(|(i, _)| i)
                .collect()
        };
        let at_experts = run(&c, &w, &tokens, &before_experts);
        assert_eq!(at_experts, whole, "{name}: cut before each MoE experts node");
        let mut rng = Rng::new(name.len() as u64);
        for _ in 0..3 {
            let seed = rng.next_u64();
            let random = |f: &Forward| -> Vec<usize> {
                let n = f.graph.nodes.len();
                let mut r = Rng::new(n as u64 ^ seed);
                let mut cuts: Vec<usize> = (0..6).map(|_| r.range(1, n)).collect();
                cuts.sort();
                cuts
            };
            assert_eq!(run(&c, &w, &tokens, &random), whole, "{name}: random cuts");
        }
    }
}

#[test]
fn carried_buffers_become_states_and_unused_outputs_hold_nothing() {
    let name = "qwen3_moe";
    let c = ModelConfig::from_dir(&dir(name)).unwrap();
    let w = Weights::open(&dir(name)).unwrap();
    let f = Forward::build(&c, &w, spec(3, 0)).unwrap();
    let n = f.graph.nodes.len();
    let segments = f.graph.split(&[n / 2, 0, n / 2, n + 5]);
    assert_eq!(segments.len(), 2, "0, repeats and cuts past the end are ignored");
    assert_eq!(segments[0].nodes.len() + segments[1].nodes.len(), n);
    let carried: Vec<_> = segments[0]
        .bufs
        .iter()
        .filter(|d| d.label.starts_with("carry:"))
        .collect();
    assert!(!carried.is_empty(), "the residual stream crosses the cut");
    assert!(carried.iter().all(|d| d.kind == BufKind::State));
    assert_eq!(segments[0].bufs.len(), f.graph.bufs.len());
    // The logits are written in the second segment only.
    assert_eq!(segments[0].decl(f.logits).kind, BufKind::Transient);
    assert_eq!(segments[1].decl(f.logits).kind, BufKind::Output);
    assert_eq!(segments[1].decl(f.tokens).kind, BufKind::Transient);
}
