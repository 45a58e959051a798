//! The kernel registry: CUDA C modules (sources the caller embeds in its binary, with the
//! headers they include and the preprocessor definitions they share with host code), compiled
//! by NVRTC for the device's architecture and cached on disk so a second start compiles nothing.
//!
//! The cache key hashes the source, its headers, the NVRTC options (which name the
//! architecture, the include directory and every `-D` definition) and the NVRTC version; a
//! module is stored as `<cache>/<module>-<key>.cubin`.

use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys as drv, CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc, Ptx};
use sha2::{Digest, Sha256};

use crate::counters::Counters;
use crate::error::{CudaError, Result};

/// One CUDA C module: its source, the headers it includes (handed to NVRTC in memory) and
/// the numbers host code shares with it, passed as `-DNAME=VALUE` so each is written once.
#[derive(Debug, Clone, Copy)]
pub struct ModuleSource {
    pub name: &'static str,
    pub source: &'static str,
    /// (include name, contents).
    pub headers: &'static [(&'static str, &'static str)],
    /// (macro name, value).
    pub defines: &'static [(&'static str, i64)],
}

/// The programmatic-dependent-launch primitives (`pdl_wait`, `pdl_trigger`, `pdl_begin`) and
/// their contract, for modules whose dispatches are recorded as programmatic.
pub const PDL_HEADER: (&str, &str) = ("pdl.cuh", include_str!("../kernels/pdl.cuh"));

/// The runtime's own kernels: small element-wise ones for `kestrel doctor`, the runtime tests
/// and the runtime benchmark.
pub const RUNTIME_MODULE: ModuleSource = ModuleSource {
    name: "runtime",
    source: include_str!("../kernels/runtime.cu"),
    headers: &[PDL_HEADER],
    defines: &[],
};

/// Where a module came from when it was loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOrigin {
    Compiled,
    DiskCache,
    AlreadyLoaded,
}

/// A loaded kernel function.
#[derive(Clone)]
pub struct Kernel {
    inner: Arc<KernelInner>,
}

struct KernelInner {
    func: CudaFunction,
    module: String,
    name: String,
    /// The function's dynamic shared-memory limit as last read from the driver or raised (0
    /// until a launch asks for some).
    shared_limit: AtomicU32,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({}::{})", self.inner.module, self.inner.name)
    }
}

impl PartialEq for Kernel {
    fn eq(&self, other: &Self) -> bool {
        self.inner.func.cu_function() == other.inner.func.cu_function()
    }
}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub fn module(&self) -> &str {
        &self.inner.module
    }

    pub(crate) fn cu_function(&self) -> drv::CUfunction {
        self.inner.func.cu_function()
    }

    /// The function's limits as the driver reports them (for error messages).
    pub(crate) fn limits(&self) -> String {
        use drv::CUfunction_attribute::*;
        let attr = |a| {
            let mut v = 0i32;
            // SAFETY: a valid function handle whose module is kept alive by `func`; `v` is a
            // valid out-pointer.
            match unsafe { drv::cuFuncGetAttribute(&mut v, a, self.cu_function()).result() } {
                Ok(()) => v.to_string(),
                Err(e) => format!("({e:?})"),
            }
        };
        format!(
            "function: max dynamic shared {} bytes, static shared {} bytes, max threads {}, registers {}",
            attr(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES),
            attr(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
            attr(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            attr(CU_FUNC_ATTRIBUTE_NUM_REGS)
        )
    }

    /// Opts the function into `bytes` of dynamic shared memory when that exceeds its limit. The
    /// limit is the driver's: by default 48 KiB less the function's static shared memory.
    pub(crate) fn ensure_shared_mem(&self, bytes: u32) -> Result<()> {
        if bytes <= self.inner.shared_limit.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut limit = 0i32;
        // SAFETY: a valid function handle whose module is kept alive by `func`; `limit` is a
        // valid out-pointer.
        unsafe {
            drv::cuFuncGetAttribute(
                &mut limit,
                drv::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                self.cu_function(),
            )
            .result()
        }
        .map_err(CudaError::driver("cuFuncGetAttribute"))?;
        let limit = u32::try_from(limit).unwrap_or(0);
        if bytes <= limit {
            self.inner.shared_limit.fetch_max(limit, Ordering::Relaxed);
            return Ok(());
        }
        // SAFETY: a valid function handle whose module is kept alive by `func`.
        unsafe {
            drv::cuFuncSetAttribute(
                self.cu_function(),
                drv::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .result()
        }
        .map_err(CudaError::driver("cuFuncSetAttribute"))?;
        self.inner.shared_limit.fetch_max(bytes, Ordering::Relaxed);
        Ok(())
    }
}

/// Whether modules for this device can be built for Hopper's own target, `sm_90a`, whose
/// instructions (`wgmma`) only sm_90 runs: an sm_90 device and NVRTC 12 or newer (11.8 knows
/// sm_90 but not sm_90a).
pub fn hopper_target(compute_capability: (u32, u32), nvrtc: Option<(i32, i32)>) -> bool {
    compute_capability == (9, 0) && nvrtc.is_some_and(|v| v >= (12, 0))
}

/// The NVRTC architecture for a compute capability: `sm_XY`, or `sm_90a` where `hopper_target`
/// says so; modules are built for exactly the device.
pub fn arch_name(compute_capability: (u32, u32), hopper: bool) -> String {
    let (major, minor) = compute_capability;
    let feature = if hopper { "a" } else { "" };
    format!("sm_{major}{minor}{feature}")
}

pub struct KernelRegistry {
    ctx: Arc<CudaContext>,
    arch: String,
    cache_dir: Option<PathBuf>,
    include_dir: Option<PathBuf>,
    counters: Arc<Counters>,
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    /// One `Kernel` per (module, function): the shared-memory opt-in is a property of the
    /// function, so every dispatch of it must see the largest one made (a second handle with its
    /// own record would lower the attribute under nodes that need more).
    functions: Mutex<HashMap<(String, String), Kernel>>,
}

impl KernelRegistry {
    pub(crate) fn new(
        ctx: Arc<CudaContext>,
        arch: String,
        cache_dir: Option<PathBuf>,
        include_dir: Option<PathBuf>,
        counters: Arc<Counters>,
    ) -> Self {
        KernelRegistry {
            ctx,
            arch,
            cache_dir,
            include_dir,
            counters,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        }
    }

    /// The architecture kernels are compiled for, e.g. `sm_90a`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn cache_dir(&self) -> Option<&Path> {
        self.cache_dir.as_deref()
    }

    /// Function `function` of `module`, compiling or loading the module on first use.
    pub fn kernel(&self, module: &ModuleSource, function: &str) -> Result<Kernel> {
        self.load_module(module)?;
        self.function(module.name, function)
    }

    /// Loads `module` (see [`Self::load`]).
    pub fn load_module(&self, module: &ModuleSource) -> Result<LoadOrigin> {
        self.load_with(module.name, module.source, module.headers, module.defines)
    }

    /// Function `function` of a module loaded earlier.
    pub fn function(&self, module: &str, function: &str) -> Result<Kernel> {
        let key = (module.to_string(), function.to_string());
        if let Some(k) = self.functions.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(k.clone());
        }
        let m = self
            .modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(module)
            .cloned()
            .ok_or_else(|| CudaError::NoSuchModule(module.to_string()))?;
        let func = m.load_function(function).map_err(|_| CudaError::NoSuchKernel {
            module: module.to_string(),
            function: function.to_string(),
        })?;
        let k = Kernel {
            inner: Arc::new(KernelInner {
                func,
                module: module.to_string(),
                name: function.to_string(),
                shared_limit: AtomicU32::new(0),
            }),
        };
        self.functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, k.clone());
        Ok(k)
    }

    /// Loads module `name` from `source`, which includes no headers: from memory if already
    /// loaded, else from the disk cache, else by compiling it.
    pub fn load(&self, name: &str, source: &str) -> Result<LoadOrigin> {
        self.load_with(name, source, &[], &[])
    }

    fn load_with(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        defines: &[(&str, i64)],
    ) -> Result<LoadOrigin> {
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        // Every dispatch's kernel lookup comes here: a loaded module returns before any hashing.
        if modules.contains_key(name) {
            return Ok(LoadOrigin::AlreadyLoaded);
        }
        let (options, path) = self.plan(name, source, headers, defines)?;
        if let Some(origin) = self.load_cached(&mut modules, name, path.as_deref()) {
            return Ok(origin);
        }
        let cubin = compile(name, source, headers, &options)?;
        self.install(&mut modules, name, cubin, path.as_deref())?;
        Ok(LoadOrigin::Compiled)
    }

    /// Loads every module of `modules` as [`Self::load_module`] does, but compiles those neither
    /// loaded nor in the disk cache at the same time, a thread each (NVRTC compiles separate
    /// programs concurrently), so a first start waits for its longest module rather than for
    /// all of them in turn. Returns each module's origin, in order.
    pub fn load_modules(&self, modules: &[ModuleSource]) -> Result<Vec<LoadOrigin>> {
        let mut origins = Vec::with_capacity(modules.len());
        let mut missing = Vec::new();
        for m in modules {
            let mut loaded = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            if loaded.contains_key(m.name) {
                origins.push(LoadOrigin::AlreadyLoaded);
                continue;
            }
            let (options, path) = self.plan(m.name, m.source, m.headers, m.defines)?;
            let origin = self.load_cached(&mut loaded, m.name, path.as_deref());
            if origin.is_none() {
                missing.push((m, options, path));
            }
            origins.push(origin.unwrap_or(LoadOrigin::Compiled));
        }
        let cubins: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let compiling: Vec<_> = missing
                .iter()
                .map(|(m, options, _)| s.spawn(move || compile(m.name, m.source, m.headers, options)))
                .collect();
            compiling
                .into_iter()
                .zip(&missing)
                .map(|(t, (m, _, _))| {
                    t.join().unwrap_or_else(|_| {
                        Err(CudaError::Nvrtc {
                            module: m.name.to_string(),
                            message: "the compiling thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        for ((m, _, path), cubin) in missing.iter().zip(cubins) {
            let mut loaded = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            // Another caller may have loaded it meanwhile.
            if !loaded.contains_key(m.name) {
                self.install(&mut loaded, m.name, cubin?, path.as_deref())?;
            }
        }
        Ok(origins)
    }

    /// The NVRTC options of a module and where the disk cache keeps it (None: no cache).
    fn plan(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        defines: &[(&str, i64)],
    ) -> Result<(Vec<String>, Option<PathBuf>)> {
        let options = self.options(defines);
        let key = cache_key(source, headers, &options, nvrtc_version()?);
        let path = self
            .cache_dir
            .as_ref()
            .map(|d| d.join(format!("{name}-{key}.cubin")));
        Ok((options, path))
    }

    /// Module `name` (not loaded yet) loaded from the disk cache at `path`; None when it has to
    /// be compiled.
    fn load_cached(
        &self,
        modules: &mut HashMap<String, Arc<CudaModule>>,
        name: &str,
        path: Option<&Path>,
    ) -> Option<LoadOrigin> {
        let image = std::fs::read(path?).ok()?;
        // A corrupt or foreign file fails to load and is simply recompiled over.
        let module = self.ctx.load_module(Ptx::from_binary(image)).ok()?;
        self.counters.add_kernel_cache_hits(1);
        modules.insert(name.to_string(), module);
        Some(LoadOrigin::DiskCache)
    }

    /// Loads a freshly compiled module and writes it to the disk cache at `path`.
    fn install(
        &self,
        modules: &mut HashMap<String, Arc<CudaModule>>,
        name: &str,
        cubin: Vec<u8>,
        path: Option<&Path>,
    ) -> Result<()> {
        self.counters.add_kernel_compiles(1);
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin.clone()))
            .map_err(CudaError::driver("cuModuleLoadData"))?;
        modules.insert(name.to_string(), module);
        if let Some(path) = path {
            write_atomically(path, &cubin).map_err(|source| CudaError::Cache {
                path: path.to_path_buf(),
                source,
            })?;
        }
        Ok(())
    }

    fn options(&self, defines: &[(&str, i64)]) -> Vec<String> {
        options(&self.arch, self.include_dir.as_deref(), defines)
    }
}

/// The NVRTC options of a module of `defines` for `arch`, with the CUDA headers from `include`.
fn options(arch: &str, include: Option<&Path>, defines: &[(&str, i64)]) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    if let Some(inc) = include {
        o.push(format!("--include-path={}", inc.display()));
    }
    o.extend(defines.iter().map(|(name, value)| format!("-D{name}={value}")));
    o
}

/// `module` compiled by NVRTC for `arch` (`sm_90a`, `sm_80`, ...) with the options a registry
/// gives it and the CUDA headers from `include`, without a device: the cubin, for checks of what
/// a module holds (`cubin_has_function`). Needs NVRTC.
pub fn compile_module(module: &ModuleSource, arch: &str, include: Option<&Path>) -> Result<Vec<u8>> {
    ensure_nvrtc()?;
    compile(
        module.name,
        module.source,
        module.headers,
        &options(arch, include, module.defines),
    )
}

/// Whether `cubin` (from `compile_module`) defines the function `name`: its symbol name, whole,
/// in the cubin's string table.
pub fn cubin_has_function(cubin: &[u8], name: &str) -> bool {
    let symbol = [b"\0", name.as_bytes(), b"\0"].concat();
    cubin.windows(symbol.len()).any(|w| w == symbol.as_slice())
}

/// NVRTC's version, part of the cache key: a new compiler may produce different code.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Nvrtc {
            module: String::new(),
            message: format!("nvrtcVersion: {e:?}"),
        })?;
    Ok((major, minor))
}

fn ensure_nvrtc() -> Result<()> {
    // SAFETY: only probes whether the shared library can be opened.
    if unsafe { nvrtc::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoNvrtc)
    }
}

fn cache_key(source: &str, headers: &[(&str, &str)], options: &[String], version: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for (name, text) in headers {
        h.update([0u8]);
        h.update(name.as_bytes());
        h.update(text.as_bytes());
    }
    for o in options {
        h.update([0u8]);
        h.update(o.as_bytes());
    }
    h.update(format!("\0nvrtc {}.{}", version.0, version.1).as_bytes());
    h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect()
}

/// Compiles `source` to a cubin; a failure carries NVRTC's log and names the module.
fn compile(module: &str, source: &str, headers: &[(&str, &str)], options: &[String]) -> Result<Vec<u8>> {
    ensure_nvrtc()?;
    let nvrtc_err = |what: &str, e: nvrtc_result::NvrtcError| CudaError::Nvrtc {
        module: module.to_string(),
        message: format!("{what}: {e:?}"),
    };
    let src = CString::new(source).map_err(|_| CudaError::Nvrtc {
        module: module.to_string(),
        message: "source contains a NUL byte".into(),
    })?;
    let file = CString::new(format!("{module}.cu")).expect("module names have no NUL");
    let header_texts: Vec<CString> = headers
        .iter()
        .map(|h| CString::new(h.1).expect("headers have no NUL"))
        .collect();
    let header_names: Vec<CString> = headers
        .iter()
        .map(|h| CString::new(h.0).expect("header names have no NUL"))
        .collect();
    let texts: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let names: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a NUL-terminated string alive until the program is
    // destroyed (they live to the end of this function; `Program` drops first).
    unsafe {
        nvrtc::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            file.as_ptr(),
            headers.len() as i32,
            texts.as_ptr(),
            names.as_ptr(),
        )
    }
    .result()
    .map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?;
    let program = Program(prog);
    // SAFETY: `prog` is a live program (destroyed by `Program`'s Drop), `src` and `file` outlive it.
    let compiled = unsafe { nvrtc_result::compile_program(program.0, options) };
    if let Err(e) = compiled {
        let log = program.log().unwrap_or_else(|| format!("(no log; {e:?})"));
        return Err(CudaError::Compile {
            module: module.to_string(),
            options: options.join(" "),
            log,
        });
    }
    let mut size = 0usize;
    // SAFETY: a successfully compiled program; `size` is a valid out-pointer.
    unsafe { nvrtc::nvrtcGetCUBINSize(program.0, &mut size) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the size NVRTC reported.
    unsafe { nvrtc::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
    Ok(cubin)
}

/// Owns an NVRTC program and destroys it on every path.
struct Program(nvrtc::nvrtcProgram);

impl Program {
    fn log(&self) -> Option<String> {
        let mut size = 0usize;
        // SAFETY: a live program; valid out-pointer.
        unsafe { nvrtc::nvrtcGetProgramLogSize(self.0, &mut size) }
            .result()
            .ok()?;
        let mut buf = vec![0u8; size.max(1)];
        // SAFETY: `buf` has the size NVRTC reported (NUL included).
        unsafe { nvrtc::nvrtcGetProgramLog(self.0, buf.as_mut_ptr() as *mut c_char) }
            .result()
            .ok()?;
        let text = CStr::from_bytes_until_nul(&buf)
            .ok()?
            .to_string_lossy()
            .trim()
            .to_string();
        Some(text)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        let _ = unsafe { nvrtc_result::destroy_program(self.0) };
    }
}

/// Writes through a temporary file and a rename, so a reader never sees a partial module.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_source_headers_options_and_version() {
        let o = vec!["--gpu-architecture=sm_90".to_string()];
        let h = [("h.cuh", "int x;")];
        let base = cache_key("a", &h, &o, (13, 0));
        assert_eq!(base, cache_key("a", &h, &o, (13, 0)));
        assert_ne!(base, cache_key("b", &h, &o, (13, 0)));
        assert_ne!(base, cache_key("a", &[("h.cuh", "int y;")], &o, (13, 0)));
        assert_ne!(base, cache_key("a", &[], &o, (13, 0)));
        assert_ne!(
            base,
            cache_key("a", &h, &["--gpu-architecture=sm_80".to_string()], (13, 0))
        );
        let mut defined = o.clone();
        defined.push("-DTILE=64".to_string());
        assert_ne!(base, cache_key("a", &h, &defined, (13, 0)));
        assert_ne!(base, cache_key("a", &h, &o, (13, 1)));
        assert_eq!(base.len(), 24);
    }

    #[test]
    fn hopper_builds_for_its_feature_target_and_others_for_their_own() {
        assert!(hopper_target((9, 0), Some((13, 0))));
        assert!(hopper_target((9, 0), Some((12, 0))));
        assert!(!hopper_target((9, 0), Some((11, 8))), "NVRTC 11.8 has no sm_90a");
        assert!(!hopper_target((9, 0), None));
        assert!(!hopper_target((10, 0), Some((13, 0))), "wgmma is sm_90 only");
        assert_eq!(arch_name((9, 0), true), "sm_90a");
        assert_eq!(arch_name((9, 0), false), "sm_90");
        assert_eq!(arch_name((8, 6), false), "sm_86");
        assert_eq!(arch_name((12, 0), false), "sm_120");
    }

    /// Programs compiled at the same time on several threads come out as compiled one by one
    /// (needs NVRTC, not a device: skipped with a notice where NVRTC cannot be opened).
    #[test]
    fn programs_compiled_at_once_equal_those_compiled_in_turn() {
        use std::io::Write;
        if nvrtc_version().is_err() {
            // The notice through a write that returns its error (the skip must be seen).
            let _ = writeln!(
                std::io::stderr(),
                "skipped programs_compiled_at_once_equal_those_compiled_in_turn: no NVRTC here"
            );
            return;
        }
        let sources: Vec<(String, String)> = (0..4)
            .map(|i| {
                (
                    format!("probe{i}"),
                    format!(
                        "extern \"C\" __global__ void k{i}(float* x, unsigned n) {{ unsigned j = blockIdx.x * \
                         blockDim.x + threadIdx.x; if (j < n) x[j] = x[j] * {i}.5f + (float)PLUS; }}"
                    ),
                )
            })
            .collect();
        let options = vec!["--gpu-architecture=sm_80".to_string(), "-DPLUS=7".to_string()];
        let in_turn: Vec<Vec<u8>> = sources
            .iter()
            .map(|(name, src)| compile(name, src, &[], &options).unwrap())
            .collect();
        let at_once: Vec<Vec<u8>> = std::thread::scope(|s| {
            let threads: Vec<_> = sources
                .iter()
                .map(|(name, src)| s.spawn(|| compile(name, src, &[], &options).unwrap()))
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert!(in_turn.iter().all(|c| !c.is_empty()));
        assert!(at_once == in_turn, "a program compiled beside others differs");
    }

    #[test]
    fn atomic_write_creates_directories() {
        let dir = std::env::temp_dir().join(format!("kestrel-cache-test-{}", std::process::id()));
        let path = dir.join("sub").join("m-0.cubin");
        write_atomically(&path, b"abc").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abc");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
