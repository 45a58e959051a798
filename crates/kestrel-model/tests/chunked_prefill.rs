//! A prompt prefilled in chunks (caches and recurrent states carried from chunk to chunk) gives
//! the logits of one prefill of the whole prompt, for every architecture and several chunk sizes,
//! and the next token picked on the backend is the reference's argmax.

mod common;

use common::{dir, reference, rel_max_err, FIXTURES};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{Session, Want};

#[test]
fn chunked_prefill_equals_one_prefill() {
    for name in FIXTURES {
        let (tokens, want, _) = reference(name);
        for chunk in [1, 5, 12] {
            let open = || {
                Session::open(&dir(name), CpuBackend::new(), 64, DType::F32)
                    .unwrap()
                    .with_prefill_chunk(Some(chunk))
                    .unwrap()
            };
            let mut s = open();
            let got = s
                .step(&tokens, 0, Want::AllLogits)
                .unwrap()
                .into_logits()
                .unwrap();
            let err = rel_max_err(&got, &want);
            assert!(err <= 1e-5, "{name} in chunks of {chunk}: {err:e}");
            // Only the last token's logits without all_logits.
            let mut s = open();
            let last = s
                .step(&tokens, 0, Want::LastLogits)
                .unwrap()
                .into_logits()
                .unwrap();
            assert_eq!(last.len(), 256);
            assert!(rel_max_err(&last, &want[want.len() - 256..]) <= 1e-5, "{name}");
            // The argmax taken on the backend is the host's.
            let mut s = open();
            let id = s.step(&tokens, 0, Want::Argmax).unwrap().token().unwrap();
            assert_eq!(id, common::argmax(&want[want.len() - 256..]), "{name}");
        }
    }
}

/// Steps of more lengths and outputs than a session keeps programs for: the least recently used
/// program goes, the session holds at most `MAX_PROGRAMS`, and a step run again after its
/// program went computes the reference's logits.
#[test]
fn steps_of_many_lengths_keep_a_bounded_number_of_programs() {
    let name = FIXTURES[0];
    let (tokens, want, _) = reference(name);
    let mut s = Session::open(&dir(name), CpuBackend::new(), 64, DType::F32).unwrap();
    let steps: Vec<(usize, Want)> = (1..=tokens.len())
        .flat_map(|len| {
            [
                (len, Want::AllLogits),
                (len, Want::LastLogits),
                (len, Want::Argmax),
            ]
        })
        .chain([(1, Want::AllLogits), (2, Want::Argmax)])
        .collect();
    assert!(
        steps.len() > kestrel_model::MAX_PROGRAMS + 2,
        "the fixture is too short for this test"
    );
    for (len, want_out) in steps {
        s.reset_states().unwrap();
        let last = &want[(len - 1) * 256..len * 256];
        match s.step(&tokens[..len], 0, want_out).unwrap() {
            kestrel_model::Output::Token(id) => assert_eq!(id, common::argmax(last), "{len} tokens"),
            kestrel_model::Output::Logits(got) => {
                let reference = if want_out == Want::AllLogits {
                    &want[..len * 256]
                } else {
                    last
                };
                let err = rel_max_err(&got, reference);
                assert!(err <= 1e-5, "{name}, {len} tokens, {want_out:?}: {err:e}");
            }
        }
        assert!(
            s.programs_held() <= kestrel_model::MAX_PROGRAMS,
            "{}",
            s.programs_held()
        );
    }
    assert_eq!(s.programs_held(), kestrel_model::MAX_PROGRAMS);
}

/// A second sequence from position 0 after `reset_states` computes as a fresh session does; the
/// hybrids' recurrent states would otherwise carry the first sequence into it.
#[test]
fn a_reset_session_starts_a_new_sequence() {
    for name in FIXTURES {
        let (tokens, want, _) = reference(name);
        let mut s = Session::open(&dir(name), CpuBackend::new(), 64, DType::F32).unwrap();
        let other: Vec<u32> = tokens.iter().rev().copied().collect();
        s.step(&other, 0, Want::AllLogits).unwrap().into_logits().unwrap();
        let stale = s
            .step(&tokens, 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap();
        s.reset_states().unwrap();
        let fresh = s
            .step(&tokens, 0, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap();
        assert!(rel_max_err(&fresh, &want) <= 1e-5, "{name}");
        let hybrid = name.contains("next") || name.contains("3_5");
        assert_eq!(
            rel_max_err(&stale, &want) > 1e-3,
            hybrid,
            "{name}: states carry over only in hybrids"
        );
    }
}
