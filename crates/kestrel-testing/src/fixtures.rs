//! Where test data lives: paths relative to the repository root, which is `KESTREL_TEST_ROOT`
//! when set (a GPU test bundle copied to another machine sets it to the folder it carries the
//! fixtures in), else the checkout the tests were built from.

use std::path::PathBuf;

use kestrel_core::TestSwitches;

/// The repository root fixture paths are relative to.
///
/// # Panics
/// When the test switches in the environment are invalid (the run is misconfigured).
pub fn root() -> PathBuf {
    let switches = TestSwitches::from_env().expect("invalid Kestrel test switches in the environment");
    switches
        .test_root
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")))
}

/// `relative` (e.g. `crates/kestrel-model/tests/parity`) under the repository root.
pub fn path(relative: &str) -> PathBuf {
    root().join(relative)
}
