//! The one configuration of a Kestrel process, read once from the environment.
//!
//! Every knob lives here, with its variable, type and default; nothing else in Kestrel reads
//! the environment. Command-line flags override these values after they are read.
//!
//! | variable | type | default | meaning |
//! | --- | --- | --- | --- |
//! | `KESTREL_DEVICE` | integer | `0` | CUDA device ordinal used by default |
//! | `KESTREL_KERNEL_CACHE` | path or `off` | `$XDG_CACHE_HOME/kestrel/kernels`, else `$HOME/.cache/kestrel/kernels` | where compiled kernel modules are cached |
//! | `KESTREL_CUDA_INCLUDE` | path | `$CUDA_HOME/include`, `$CUDA_PATH/include` or `/usr/local/cuda/include`, the first that exists | headers (`cuda_bf16.h`, `cuda_fp16.h`) given to NVRTC |
//! | `KESTREL_PROFILE` | bool | `false` | time every dispatch with CUDA events |
//! | `KESTREL_PDL` | bool | `true` | programmatic dependent launch in CUDA graphs (`off` links every kernel to its predecessors by completion, for debugging) |
//! | `KESTREL_WGMMA` | bool | `true` | on sm_90 GPUs, grouped expert GEMMs and quantised products of many tokens on Hopper's warpgroup tensor-core instructions (`off` takes the `mma.sync` kernels other GPUs use) |
//!
//! Booleans accept `1/0`, `true/false`, `yes/no`, `on/off`. The test suite has two switches of
//! its own, read here too but into their own struct, [`TestSwitches`], which only the
//! `kestrel-testing` crate uses: `KESTREL_REQUIRE_GPU` (a missing CUDA device fails GPU tests
//! instead of skipping them) and `KESTREL_TEST_ROOT` (the repository root test fixtures are read
//! under; a GPU test bundle sets it to the folder it carries them in).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{CoreError, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// CUDA device ordinal used when none is given on the command line.
    pub device: usize,
    /// Directory for compiled kernel modules; `None` disables the disk cache.
    pub kernel_cache_dir: Option<PathBuf>,
    /// Directory holding the CUDA headers NVRTC includes; `None` relies on NVRTC's built-ins.
    pub cuda_include_dir: Option<PathBuf>,
    /// Time each dispatch with CUDA events and aggregate by label and kernel.
    pub profile: bool,
    /// CUDA graphs link programmatic dispatches by programmatic edges (else by completion).
    pub pdl: bool,
    /// Hopper (sm_90) runs its tensor-core GEMM tiles on `wgmma` (else on `mma.sync`).
    pub wgmma: bool,
}

impl Default for Config {
    /// The configuration of an empty environment.
    fn default() -> Self {
        Config::from_vars(&HashMap::new()).expect("an empty environment is a valid configuration")
    }
}

/// The test suite's switches (see the module's table); never part of a production run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TestSwitches {
    pub require_gpu: bool,
    pub test_root: Option<PathBuf>,
}

impl TestSwitches {
    /// Reads the process environment.
    pub fn from_env() -> Result<TestSwitches> {
        let vars: HashMap<String, String> = std::env::vars().collect();
        TestSwitches::from_vars(&vars)
    }

    pub fn from_vars(vars: &HashMap<String, String>) -> Result<TestSwitches> {
        let get = |k: &str| vars.get(k).map(|s| s.trim()).filter(|s| !s.is_empty());
        Ok(TestSwitches {
            require_gpu: parse_bool(get("KESTREL_REQUIRE_GPU"), "KESTREL_REQUIRE_GPU")?,
            test_root: get("KESTREL_TEST_ROOT").map(PathBuf::from),
        })
    }
}

impl Config {
    /// Reads the process environment. Call once, at start-up, and pass the result down.
    pub fn from_env() -> Result<Config> {
        let vars: HashMap<String, String> = std::env::vars().collect();
        Config::from_vars(&vars)
    }

    /// Builds the configuration from an explicit set of variables (the environment, or a test's).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Config> {
        let get = |k: &str| vars.get(k).map(|s| s.trim()).filter(|s| !s.is_empty());

        let device = match get("KESTREL_DEVICE") {
            None => 0,
            Some(v) => v.parse().map_err(|_| CoreError::InvalidConfig {
                var: "KESTREL_DEVICE",
                value: v.to_string(),
                reason: "expected a device ordinal such as 0".into(),
            })?,
        };

        let kernel_cache_dir = match get("KESTREL_KERNEL_CACHE") {
            Some(v) if v.eq_ignore_ascii_case("off") => None,
            Some(v) => Some(PathBuf::from(v)),
            None => get("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| get("HOME").map(|h| Path::new(h).join(".cache")))
                .map(|base| base.join("kestrel").join("kernels")),
        };

        let cuda_include_dir = match get("KESTREL_CUDA_INCLUDE") {
            Some(v) => {
                let p = PathBuf::from(v);
                if !p.is_dir() {
                    return Err(CoreError::MissingPath {
                        var: "KESTREL_CUDA_INCLUDE",
                        path: p,
                    });
                }
                Some(p)
            }
            None => [get("CUDA_HOME"), get("CUDA_PATH"), Some("/usr/local/cuda")]
                .into_iter()
                .flatten()
                .map(|root| Path::new(root).join("include"))
                .find(|p| p.join("cuda_fp16.h").is_file()),
        };

        Ok(Config {
            device,
            kernel_cache_dir,
            cuda_include_dir,
            profile: parse_bool(get("KESTREL_PROFILE"), "KESTREL_PROFILE")?,
            pdl: match get("KESTREL_PDL") {
                None => true,
                v => parse_bool(v, "KESTREL_PDL")?,
            },
            wgmma: match get("KESTREL_WGMMA") {
                None => true,
                v => parse_bool(v, "KESTREL_WGMMA")?,
            },
        })
    }
}

fn parse_bool(value: Option<&str>, var: &'static str) -> Result<bool> {
    let Some(v) = value else { return Ok(false) };
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(CoreError::InvalidConfig {
            var,
            value: v.to_string(),
            reason: "expected one of 1/0, true/false, yes/no, on/off".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_from_an_empty_environment() {
        let c = Config::from_vars(&vars(&[])).unwrap();
        assert_eq!(c.device, 0);
        assert!(!c.profile);
        assert!(c.pdl);
        assert!(!Config::from_vars(&vars(&[("KESTREL_PDL", "off")])).unwrap().pdl);
        assert!(Config::from_vars(&vars(&[("KESTREL_PDL", "maybe")])).is_err());
        assert!(c.wgmma);
        assert!(!Config::from_vars(&vars(&[("KESTREL_WGMMA", "0")])).unwrap().wgmma);
        assert_eq!(c.kernel_cache_dir, None, "no HOME, no XDG_CACHE_HOME: no cache");
    }

    #[test]
    fn cache_dir_follows_xdg_then_home_and_can_be_disabled() {
        let c = Config::from_vars(&vars(&[("HOME", "/home/u")])).unwrap();
        assert_eq!(
            c.kernel_cache_dir,
            Some(PathBuf::from("/home/u/.cache/kestrel/kernels"))
        );
        let c = Config::from_vars(&vars(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/xdg")])).unwrap();
        assert_eq!(c.kernel_cache_dir, Some(PathBuf::from("/xdg/kestrel/kernels")));
        let c = Config::from_vars(&vars(&[("HOME", "/home/u"), ("KESTREL_KERNEL_CACHE", "OFF")])).unwrap();
        assert_eq!(c.kernel_cache_dir, None);
        let c = Config::from_vars(&vars(&[("KESTREL_KERNEL_CACHE", "/tmp/k")])).unwrap();
        assert_eq!(c.kernel_cache_dir, Some(PathBuf::from("/tmp/k")));
    }

    #[test]
    fn booleans_and_device() {
        let c = Config::from_vars(&vars(&[("KESTREL_PROFILE", "on"), ("KESTREL_DEVICE", " 3 ")])).unwrap();
        assert!(c.profile);
        assert_eq!(c.device, 3);
        let c = Config::from_vars(&vars(&[("KESTREL_PROFILE", "False")])).unwrap();
        assert!(!c.profile);
    }

    #[test]
    fn test_switches_are_read_apart_from_the_configuration() {
        let t = TestSwitches::from_vars(&vars(&[
            ("KESTREL_REQUIRE_GPU", "1"),
            ("KESTREL_TEST_ROOT", "/b"),
        ]))
        .unwrap();
        assert!(t.require_gpu);
        assert_eq!(t.test_root, Some(PathBuf::from("/b")));
        assert_eq!(
            TestSwitches::from_vars(&vars(&[])).unwrap(),
            TestSwitches::default()
        );
        let e = TestSwitches::from_vars(&vars(&[("KESTREL_REQUIRE_GPU", "maybe")])).unwrap_err();
        assert!(e.to_string().contains("KESTREL_REQUIRE_GPU"), "{e}");
    }

    #[test]
    fn invalid_values_name_the_variable() {
        let e = Config::from_vars(&vars(&[("KESTREL_PROFILE", "maybe")])).unwrap_err();
        assert!(e.to_string().contains("KESTREL_PROFILE"), "{e}");
        let e = Config::from_vars(&vars(&[("KESTREL_DEVICE", "gpu0")])).unwrap_err();
        assert!(e.to_string().contains("KESTREL_DEVICE"), "{e}");
        let e = Config::from_vars(&vars(&[("KESTREL_CUDA_INCLUDE", "/definitely/not/here")])).unwrap_err();
        assert!(e.to_string().contains("KESTREL_CUDA_INCLUDE"), "{e}");
    }
}
