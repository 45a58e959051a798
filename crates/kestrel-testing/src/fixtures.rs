//! Where test data lives: paths relative to the repository root, which is `KESTREL_TEST_ROOT`
//! when set (a GPU test bundle copied to another machine sets it to the folder it carries the
//! fixtures in), else the checkout the tests were built from.

use std::path::PathBuf;

/// The repository root fixture paths are relative to.
pub fn root() -> PathBuf {
    match std::env::var_os("KESTREL_TEST_ROOT") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")),
    }
}

/// `relative` (e.g. `crates/kestrel-model/tests/parity`) under the repository root.
pub fn path(relative: &str) -> PathBuf {
    root().join(relative)
}
