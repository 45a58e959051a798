//! The error type of the CUDA runtime crate, grouped by cause.

use cudarc::driver::DriverError;

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver found: {0} could not be loaded (is an NVIDIA driver installed?)")]
    NoDriver(&'static str),
    #[error("cuBLAS (libcublas) could not be loaded: install the CUDA toolkit or its cublas package")]
    NoCublas,
    #[error("cuBLAS call {call} failed: {message}")]
    Cublas { call: &'static str, message: String },
    #[error("NVRTC (libnvrtc) could not be loaded: install the CUDA toolkit or its nvrtc package")]
    NoNvrtc,
    #[error("CUDA device {ordinal} does not exist ({count} device(s) present)")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("CUDA call {call} failed: {}", describe(.source))]
    Driver {
        call: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("out of device memory: requested {requested} bytes, {free} of {total} bytes free")]
    OutOfMemory {
        requested: usize,
        free: usize,
        total: usize,
    },
    #[error("out of pinned host memory: requested {requested} bytes")]
    OutOfPinnedMemory { requested: usize },
    #[error("launch of kernel {kernel} (dispatch {dispatch:?} in submission {submission:?}) failed: {}; {detail}", describe(.source))]
    Launch {
        submission: String,
        dispatch: String,
        kernel: String,
        /// The launch shape and the function's limits.
        detail: String,
        #[source]
        source: DriverError,
    },
    #[error("device failure in submission {submission:?}: {}{}", describe(.source), sticky_note(.source))]
    Submission {
        submission: String,
        #[source]
        source: DriverError,
    },
    #[error("NVRTC failed to compile kernel module {module:?} ({options}):\n{log}")]
    Compile {
        module: String,
        options: String,
        log: String,
    },
    #[error("NVRTC error in module {module:?}: {message}")]
    Nvrtc { module: String, message: String },
    #[error("kernel {function:?} not found in module {module:?}")]
    NoSuchKernel { module: String, function: String },
    #[error("unknown kernel module {0:?}")]
    NoSuchModule(String),
    #[error("host data of {host_bytes} bytes does not fit in a buffer of {buffer_bytes} bytes")]
    CopyTooLong { host_bytes: usize, buffer_bytes: usize },
    #[error("host range [{offset}, {offset}+{len}) is outside pinned memory of {host_bytes} bytes")]
    HostRangeOutside {
        offset: usize,
        len: usize,
        host_bytes: usize,
    },
    #[error("element type mismatch: buffer holds {buffer}, host data is {host}")]
    DTypeMismatch {
        buffer: kestrel_core::DType,
        host: kestrel_core::DType,
    },
    #[error("view [{offset}, {offset}+{len}) is outside a buffer of {capacity} bytes")]
    ViewOutOfBounds {
        offset: usize,
        len: usize,
        capacity: usize,
    },
    #[error("view offset {offset} is not a multiple of the {dtype} element size")]
    MisalignedView {
        offset: usize,
        dtype: kestrel_core::DType,
    },
    #[error("fence value {value} was never signalled (last signalled: {last})")]
    FenceNotSignalled { value: u64, last: u64 },
    #[error("kernel cache at {path}: {source}")]
    Cache {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("persistent buffer {label} is declared as {new} here but was {old} before")]
    PersistentMismatch { label: String, old: String, new: String },
    #[error("node {node}: {reason}")]
    Op { node: String, reason: String },
    #[error(transparent)]
    Config(#[from] kestrel_core::CoreError),
}

impl CudaError {
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
        move |source| CudaError::Driver { call, source }
    }

    /// True for device memory refused: by an allocation, or by the driver (a graph's
    /// instantiation, say). Freeing memory may cure it.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            CudaError::OutOfMemory { .. } => true,
            CudaError::Driver { source, .. } => {
                source.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
            }
            _ => false,
        }
    }

    /// True for errors after which the CUDA context cannot be used again (illegal address,
    /// misaligned access, assertion, launch failure): the process must restart to use the GPU.
    pub fn is_sticky(&self) -> bool {
        match self {
            CudaError::Driver { source, .. }
            | CudaError::Launch { source, .. }
            | CudaError::Submission { source, .. } => is_sticky(source),
            _ => false,
        }
    }
}

pub(crate) fn is_sticky(e: &DriverError) -> bool {
    use cudarc::driver::sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
    )
}

fn describe(e: &DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n} ({t})"),
        _ => format!("{:?}", e.0),
    }
}

fn sticky_note(e: &DriverError) -> &'static str {
    if is_sticky(e) {
        "; this error is sticky: the CUDA context is unusable until the process restarts"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn out_of_memory_is_an_allocation_or_the_drivers_refusal_only() {
        let oom = CudaError::OutOfMemory {
            requested: 1 << 30,
            free: 0,
            total: 1 << 34,
        };
        assert!(oom.is_out_of_memory());
        let driver = |code| CudaError::Driver {
            call: "cuGraphInstantiate",
            source: DriverError(code),
        };
        assert!(driver(CUresult::CUDA_ERROR_OUT_OF_MEMORY).is_out_of_memory());
        assert!(!driver(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS).is_out_of_memory());
        assert!(!CudaError::OutOfPinnedMemory { requested: 1 }.is_out_of_memory());
    }
}
