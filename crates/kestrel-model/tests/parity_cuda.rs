//! End-to-end parity on the CUDA backend (graph replay, bf16 KV caches) against transformers:
//! per position cosine >= 0.999 with the fp32 reference logits and top-1 agreement >= 98%, in
//! prefill and in token-by-token decode, plus the greedy continuation's agreement reported.
//! Skips with a notice without a CUDA device (fails under `KESTREL_REQUIRE_GPU=1`).

mod common;

use common::{min_cosine, reference, run, top1_agreement, FIXTURES};
use kestrel_core::DType;
use kestrel_cuda::testing::device_or_skip;
use kestrel_cuda::{CudaBackend, RunMode};

#[test]
fn every_fixture_matches_transformers_on_cuda() {
    let Some(dev) = device_or_skip("every_fixture_matches_transformers_on_cuda") else {
        return;
    };
    for name in FIXTURES {
        let (_, want, cont) = reference(name);
        let (prefill, decode, generated) = run(
            name,
            || CudaBackend::new(dev.clone(), RunMode::Graph),
            DType::BF16,
        );
        for (mode, got) in [("prefill", &prefill), ("decode", &decode)] {
            let (cos, top1) = (min_cosine(got, &want), top1_agreement(got, &want));
            println!(
                "{name}: {mode} min cosine {cos:.6}, top-1 agreement {:.1}%",
                100.0 * top1
            );
            assert!(cos >= 0.999, "{name}: {mode} cosine {cos}");
            assert!(top1 >= 0.98, "{name}: {mode} top-1 agreement {top1}");
        }
        let same = generated.iter().zip(&cont).take_while(|(a, b)| a == b).count();
        println!(
            "{name}: greedy continuation agrees for {same} of {} tokens",
            cont.len()
        );
    }
}
