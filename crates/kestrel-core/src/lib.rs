//! Kestrel's device-independent core: element types, shapes, the one configuration struct,
//! a stable random number generator, the sampling algorithm every backend follows, the op
//! graph, its builder and memory planner, and the `Backend` trait.
#![forbid(unsafe_code)]

pub mod backend;
pub mod builder;
pub mod config;
pub mod dtype;
pub mod error;
pub mod expert_slots;
pub mod ir;
pub mod planner;
pub mod quant;
pub mod rng;
pub mod rope;
pub mod sample;
pub mod shape;

pub use backend::Backend;
pub use builder::GraphBuilder;
pub use config::{Config, TestSwitches};
pub use dtype::{DType, HostType};
pub use error::{CoreError, Result};
pub use shape::Shape;
