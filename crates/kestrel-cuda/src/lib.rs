//! Kestrel's CUDA runtime: open a device, allocate typed buffers and views, compile kernels with
//! NVRTC (cached on disk), record command lists, run them eagerly or as CUDA graphs with edges
//! inferred from buffer accesses, order streams with stage fences, and count and time it all.
//!
//! The driver, NVRTC and cuBLAS are loaded at run time, so this crate builds and its CPU-side
//! tests run on machines without CUDA; [`device_count`] reports a missing driver as an error.

pub mod backend;
pub mod blas;
pub mod buffer;
pub mod command;
pub mod counters;
pub mod device;
pub mod error;
pub mod fence;
pub mod graph;
pub mod ops;
pub mod registry;
pub mod stream;

pub use backend::{CudaBackend, CudaProgram, Encoder, RunMode};
pub use blas::Blas;
pub use buffer::{Buffer, PinnedBuffer};
pub use command::{Arg, CommandList, Dim3, Dispatch, DispatchBuilder, Scalar};
pub use counters::{CounterSnapshot, Profile, TimingStat};
pub use device::{device_count, driver_present, Device, DeviceInfo, Timer};
pub use error::{CudaError, Result};
pub use fence::StageFence;
pub use graph::{Graph, GraphUpdate};
pub use registry::{Kernel, KernelRegistry, LoadOrigin, ModuleSource, MODULES};
pub use stream::Stream;
