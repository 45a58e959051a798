//! What Kestrel's tests share; a dev-dependency of the other crates, never a dependency.
//!
//! - [`cases`]: op cases over random data of awkward shapes, with float64 references;
//! - [`layers`]: whole decoder layers of each kind as graphs with random weights;
//! - [`gpu`]: the device a GPU test runs on, or a printed skip (a failure with
//!   `KESTREL_REQUIRE_GPU=1`);
//! - [`fixtures`]: where the repository's test data is, also from a copied test bundle.
//!
//! Tests have two switches of their own, read here and nowhere in the library crates:
//! `KESTREL_REQUIRE_GPU` (a missing CUDA device fails GPU tests instead of skipping them) and
//! `KESTREL_TEST_ROOT` (the repository root that fixture paths are relative to; default the
//! checkout the tests were built from).

pub mod cases;
pub mod fixtures;
pub mod gpu;
pub mod layers;
