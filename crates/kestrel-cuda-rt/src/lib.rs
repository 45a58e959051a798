//! Kestrel's CUDA runtime: open a device, allocate typed buffers and views, compile kernels with
//! NVRTC (cached on disk), record command lists, run them eagerly or as CUDA graphs with edges
//! inferred from the byte ranges each dispatch reads and writes, order streams with stage
//! fences, and count and time it all. It knows nothing of models or ops: the backend above it
//! (`kestrel-cuda`) brings its kernels as [`ModuleSource`]s.
//!
//! The driver, NVRTC and cuBLAS are loaded at run time, so this crate builds and its CPU-side
//! tests run on machines without CUDA; [`device_count`] reports a missing driver as an error.

pub mod access;
mod blas;
pub mod buffer;
pub mod ceilings;
pub mod command;
pub mod counters;
pub mod device;
pub mod error;
pub mod fence;
pub mod graph;
pub mod registry;
pub mod stream;

pub use access::{Access, AccessMode, AllocId, DepGraph};
pub use buffer::{Buffer, PinnedBuffer};
pub use ceilings::Ceilings;
pub use command::{Arg, CommandList, Dim3, Dispatch, DispatchBuilder, Scalar};
pub use counters::{CounterSnapshot, Profile, TimingStat};
pub use device::{device_count, driver_present, Device, DeviceInfo, Timer};
pub use error::{CudaError, Result};
pub use fence::StageFence;
pub use graph::{Graph, GraphUpdate};
pub use registry::{
    compile_module, cubin_has_function, Kernel, KernelRegistry, LoadOrigin, ModuleSource, PDL_HEADER,
    RUNTIME_MODULE,
};
pub use stream::Stream;
