//! What Kestrel's tests share; a dev-dependency of the other crates, never a dependency.
//!
//! - [`cases`]: op cases over random data of awkward shapes, with float64 references;
//! - [`layers`]: whole decoder layers of each kind as graphs with random weights;
//! - [`gpu`]: the device a GPU test runs on, or a printed skip (a failure with
//!   `KESTREL_REQUIRE_GPU=1`);
//! - [`fixtures`]: where the repository's test data is, also from a copied test bundle.
//!
//! Tests have three switches of their own, read here and nowhere in the library crates:
//! `KESTREL_REQUIRE_GPU` (a missing CUDA device fails GPU tests instead of skipping them),
//! `KESTREL_TEST_ROOT` (the repository root that fixture paths are relative to; default the
//! checkout the tests were built from) and `KESTREL_TEST_SEED` (see [`seed`]).

use std::io::Write as _;

pub mod cases;
pub mod fixtures;
pub mod gpu;
pub mod layers;

/// The seed of a test that draws fresh random inputs on each run: `KESTREL_TEST_SEED` when set
/// (to repeat a run), else one drawn from the clock. Printed, so a failure can be repeated.
///
/// # Panics
/// When the test switches in the environment are invalid (the run is misconfigured).
pub fn seed(test: &str) -> u64 {
    let switches =
        kestrel_core::TestSwitches::from_env().expect("invalid Kestrel test switches in the environment");
    let seed = switches
        .seed
        .unwrap_or_else(|| kestrel_core::rng::Rng::from_time().1);
    // Through a writer that returns its error (ignored: a test's note is not worth failing it).
    let _ = writeln!(
        std::io::stderr(),
        "{test}: seed {seed} (KESTREL_TEST_SEED={seed} repeats this run)"
    );
    seed
}
