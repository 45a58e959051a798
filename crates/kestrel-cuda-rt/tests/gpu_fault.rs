//! A device fault (an illegal address) is reported as an error naming the submission that
//! faulted, and nothing panics afterwards. Its own test binary: a sticky fault poisons the
//! process's CUDA context, so no other test may share the process.

use kestrel_core::DType;
use kestrel_cuda_rt::{CommandList, CudaError, RUNTIME_MODULE};
use kestrel_testing::gpu::device_or_skip;

#[test]
fn illegal_address_is_reported_with_the_submission_label() {
    let Some(dev) = device_or_skip("illegal_address_is_reported_with_the_submission_label") else {
        return;
    };
    let fill = dev.kernel(&RUNTIME_MODULE, "fill_f32").unwrap();
    let poke = dev.kernel(&RUNTIME_MODULE, "poke_u32").unwrap();
    let buf = dev.alloc(DType::F32, 1024).unwrap();

    let mut good = CommandList::new("warm-up");
    good.dispatch(&fill)
        .cover(1024, 256)
        .write(&buf)
        .arg(1.0f32)
        .arg(1024u32)
        .record();
    dev.run(&good).unwrap();
    dev.synchronize().unwrap();

    let mut bad = CommandList::new("faulting-submission");
    bad.dispatch(&poke)
        .arg(8u64)
        .arg(7u32)
        .label("poke-null")
        .record();
    dev.run(&bad).unwrap(); // asynchronous: the fault surfaces at the next synchronisation
    let err = dev.synchronize().unwrap_err();
    println!("{err}");
    match &err {
        CudaError::Submission { submission, .. } => assert_eq!(submission, "faulting-submission"),
        other => panic!("expected a Submission error, got {other}"),
    }
    assert!(err.is_sticky(), "{err}");
    assert!(err.to_string().contains("restart"), "{err}");
    // Everything after a sticky fault fails with an error, never a panic.
    assert!(dev.run(&good).is_err());
    assert!(dev.alloc(DType::F32, 16).is_err());
    assert!(dev.download::<f32>(&buf).is_err());
}
