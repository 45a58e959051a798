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
//! | `KESTREL_WIDE_EXPERTS` | bool | `true` | with `wgmma` on, routed experts of a few to a few dozen rows each on the warpgroup form of the skinny products (`off` takes the skinny products and GEMM tiles, for comparison) |
//! | `KESTREL_WIDE_PROJECTIONS` | bool | `true` | with `wgmma` on, quantised projections of a few dozen tokens on the warpgroup form of the skinny products (`off` takes the skinny products, for comparison) |
//! | `KESTREL_FUSED_ATTENTION` | bool | `true` | on sm_90 GPUs, one token's attention inputs (norms, rotation, cache append) computed inside the decode attention kernel (`off` runs them as a kernel of their own, for comparison) |
//! | `KESTREL_FUSED_NORM` | bool | `true` | one token's RMS norm (with its residual add) computed inside the quantised product that reads it (`off` runs it as a kernel of its own, for comparison) |
//! | `KESTREL_BOUNDED_ROUTER` | bool | `true` | a router's logits of many tokens estimated on the tensor cores with a bound on their error, and computed exactly only for the experts that can be among the top k (`off` computes every logit exactly, for comparison; the chosen experts and weights are the same) |
//! | `KESTREL_SKINNY_EXPERTS_FROM` | integer | `9` | the fewest tokens whose quantised routed experts run on the skinny products, sorted by expert (fewer tokens take one token's kernels, which read each token's experts straight from their ids; on an H200 steps of 2-8 sequences ran 7-35% faster than on the skinny products; at least 2) |
//! | `KESTREL_DEQUANT_PROJECTIONS_FROM` | integer | `17`, or `33` with `KESTREL_PROJECTION_COPIES` off | the fewest tokens whose quantised projections (4- or 8-bit weights of at most 64 MiB as bf16) are dequantised to bf16 and multiplied by cuBLAS, rather than on the skinny products or the quantised GEMM tiles, which dequantise every weight once for each tile of tokens (on an H200, Qwen3-30B-A3B prefill of 160-2,048 tokens ran 9-21% faster, steps of 64-256 sequences 4-13%; with the weights dequantised at every run 32 sequences were 1.5% slower from 17, with them dequantised once (the copies) 17-32 sequences 4-7% faster); `0` never |
//! | `KESTREL_PROJECTION_COPIES` | bool | `true` | the CUDA backend keeps a bf16 copy of each projection weight the products of many tokens dequantise (see `KESTREL_DEQUANT_PROJECTIONS_FROM`), made once after the weights are written, instead of dequantising it into scratch memory at every run; the engine keeps them only where the model stays resident beside them, and counts them in its GPU budget (`off` dequantises at every run and saves their memory: about 1.8 GB for Qwen3-30B-A3B) |
//! | `KESTREL_DECODE_SPLIT_KEYS` | integer | `0` | on sm_90 GPUs, the fewest cached keys one block of decode attention takes (rounded up to its warps' batches): `0` spreads the context over one wave of blocks, a larger value gives fewer blocks a deeper share each (slower at every depth measured; for comparison and for the tests of deep splits) |
//!
//! Booleans accept `1/0`, `true/false`, `yes/no`, `on/off`. A variable with a value that does
//! not parse leaves its default in place and is kept as a problem: reading the configuration
//! never fails, and what uses the variables (the CUDA backend, through [`Config::check`]) refuses
//! to start with an error naming the variable, so a CPU run or `doctor --kernel-options` is not
//! stopped by a setting it never reads. The test suite has three switches of
//! its own, read here too but into their own struct, [`TestSwitches`], which only the
//! `kestrel-testing` crate uses: `KESTREL_REQUIRE_GPU` (a missing CUDA device fails GPU tests
//! instead of skipping them), `KESTREL_TEST_ROOT` (the repository root test fixtures are read
//! under; a GPU test bundle sets it to the folder it carries them in) and `KESTREL_TEST_SEED`
//! (the seed of tests that draw fresh random inputs, to repeat a run).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{CoreError, Result};

/// `Config::skinny_experts_from`'s default.
pub const SKINNY_EXPERTS_FROM: usize = 9;
/// `Config::dequant_projections_from`'s default, with `Config::projection_copies` on (the
/// weights dequantised once) and off (dequantised at every run).
pub const DEQUANT_PROJECTIONS_FROM: usize = 17;
pub const DEQUANT_PROJECTIONS_FROM_UNCOPIED: usize = 33;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Variables whose values did not parse (their fields hold the defaults); see
    /// [`Config::check`].
    pub problems: Vec<ConfigProblem>,
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
    /// With `wgmma`, routed experts of a few to a few dozen rows each run on the wgmma form of
    /// the skinny products (else on the skinny products and GEMM tiles).
    pub wide_experts: bool,
    /// With `wgmma`, quantised projections of a few dozen tokens run on the wgmma form of the
    /// skinny products (else on the skinny products).
    pub wide_projections: bool,
    /// On sm_90, one token's attention inputs run inside its decode attention kernel (else as a
    /// kernel of their own before it). On by default.
    pub fused_attention: bool,
    /// One token's RMS norm runs inside the quantised product that reads it (else as a kernel
    /// of its own before it). On by default.
    pub fused_norm: bool,
    /// A router's logits of many tokens are estimated with a bound first and computed exactly
    /// only where they can decide the choice (else every logit exactly). On by default.
    pub bounded_router: bool,
    /// On sm_90, the fewest cached keys a block of decode attention takes (`0`: as many blocks
    /// as one wave holds share the context).
    pub decode_split_keys: usize,
    /// The fewest tokens whose quantised routed experts run on the skinny products (sorted by
    /// expert); fewer take the few-token kernels. At least 2.
    pub skinny_experts_from: usize,
    /// The fewest tokens whose quantised projections are dequantised to bf16 and multiplied by
    /// cuBLAS (else the skinny products or the quantised GEMM tiles); `0`: never.
    pub dequant_projections_from: usize,
    /// The CUDA backend keeps bf16 copies of the projection weights it dequantises for products
    /// of many tokens, made once (else it dequantises them at every run). On by default.
    pub projection_copies: bool,
}

impl Default for Config {
    /// The configuration of an empty environment.
    fn default() -> Self {
        Config::from_vars(&HashMap::new())
    }
}

/// A configuration variable whose value is not valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    pub var: &'static str,
    pub value: String,
    pub reason: String,
}

impl From<ConfigProblem> for CoreError {
    fn from(p: ConfigProblem) -> CoreError {
        CoreError::InvalidConfig {
            var: p.var,
            value: p.value,
            reason: p.reason,
        }
    }
}

/// The test suite's switches (see the module's table); never part of a production run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TestSwitches {
    pub require_gpu: bool,
    pub test_root: Option<PathBuf>,
    /// Seed of the tests that draw fresh random inputs on each run, to repeat one.
    pub seed: Option<u64>,
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
            require_gpu: parse_bool(get("KESTREL_REQUIRE_GPU"), "KESTREL_REQUIRE_GPU", false)
                .map_err(CoreError::from)?,
            test_root: get("KESTREL_TEST_ROOT").map(PathBuf::from),
            seed: match get("KESTREL_TEST_SEED") {
                None => None,
                Some(v) => Some(v.parse().map_err(|_| CoreError::InvalidConfig {
                    var: "KESTREL_TEST_SEED",
                    value: v.to_string(),
                    reason: "expected an unsigned integer".into(),
                })?),
            },
        })
    }
}

impl Config {
    /// Reads the process environment. Call once, at start-up, and pass the result down.
    pub fn from_env() -> Config {
        let vars: HashMap<String, String> = std::env::vars().collect();
        Config::from_vars(&vars)
    }

    /// The first variable whose value is not valid, as an error naming it. Whatever reads the
    /// configuration's values calls this first.
    pub fn check(&self) -> Result<()> {
        match self.problems.first() {
            Some(p) => Err(p.clone().into()),
            None => Ok(()),
        }
    }

    /// Builds the configuration from an explicit set of variables (the environment, or a test's).
    pub fn from_vars(vars: &HashMap<String, String>) -> Config {
        let get = |k: &str| vars.get(k).map(|s| s.trim()).filter(|s| !s.is_empty());
        let mut problems = Vec::new();
        // A value that does not parse leaves the default and is kept as a problem.
        fn keep<T>(
            problems: &mut Vec<ConfigProblem>,
            r: std::result::Result<T, ConfigProblem>,
            default: T,
        ) -> T {
            r.unwrap_or_else(|p| {
                problems.push(p);
                default
            })
        }

        let device = match get("KESTREL_DEVICE") {
            None => 0,
            Some(v) => keep(
                &mut problems,
                v.parse().map_err(|_| ConfigProblem {
                    var: "KESTREL_DEVICE",
                    value: v.to_string(),
                    reason: "expected a device ordinal such as 0".into(),
                }),
                0,
            ),
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
                let ok = p.is_dir();
                keep(
                    &mut problems,
                    if ok {
                        Ok(Some(p))
                    } else {
                        Err(ConfigProblem {
                            var: "KESTREL_CUDA_INCLUDE",
                            value: v.to_string(),
                            reason: "no such directory".into(),
                        })
                    },
                    None,
                )
            }
            None => [get("CUDA_HOME"), get("CUDA_PATH"), Some("/usr/local/cuda")]
                .into_iter()
                .flatten()
                .map(|root| Path::new(root).join("include"))
                .find(|p| p.join("cuda_fp16.h").is_file()),
        };

        let profile = keep(
            &mut problems,
            parse_bool(get("KESTREL_PROFILE"), "KESTREL_PROFILE", false),
            false,
        );
        let pdl = keep(
            &mut problems,
            parse_bool(get("KESTREL_PDL"), "KESTREL_PDL", true),
            true,
        );
        let wgmma = keep(
            &mut problems,
            parse_bool(get("KESTREL_WGMMA"), "KESTREL_WGMMA", true),
            true,
        );
        let wide_experts = keep(
            &mut problems,
            parse_bool(get("KESTREL_WIDE_EXPERTS"), "KESTREL_WIDE_EXPERTS", true),
            true,
        );
        let wide_projections = keep(
            &mut problems,
            parse_bool(get("KESTREL_WIDE_PROJECTIONS"), "KESTREL_WIDE_PROJECTIONS", true),
            true,
        );
        let fused_attention = keep(
            &mut problems,
            parse_bool(get("KESTREL_FUSED_ATTENTION"), "KESTREL_FUSED_ATTENTION", true),
            true,
        );
        let fused_norm = keep(
            &mut problems,
            parse_bool(get("KESTREL_FUSED_NORM"), "KESTREL_FUSED_NORM", true),
            true,
        );
        let bounded_router = keep(
            &mut problems,
            parse_bool(get("KESTREL_BOUNDED_ROUTER"), "KESTREL_BOUNDED_ROUTER", true),
            true,
        );
        let decode_split_keys = keep(
            &mut problems,
            parse_count(
                get("KESTREL_DECODE_SPLIT_KEYS"),
                "KESTREL_DECODE_SPLIT_KEYS",
                0,
                "keys",
                0,
            ),
            0,
        );
        let skinny_experts_from = keep(
            &mut problems,
            parse_count(
                get("KESTREL_SKINNY_EXPERTS_FROM"),
                "KESTREL_SKINNY_EXPERTS_FROM",
                2,
                "tokens",
                SKINNY_EXPERTS_FROM,
            ),
            SKINNY_EXPERTS_FROM,
        );
        let projection_copies = keep(
            &mut problems,
            parse_bool(
                get("KESTREL_PROJECTION_COPIES"),
                "KESTREL_PROJECTION_COPIES",
                true,
            ),
            true,
        );
        // The dequantised path pays from fewer tokens when the dequantisation is done once.
        let dequant_default = match projection_copies {
            true => DEQUANT_PROJECTIONS_FROM,
            false => DEQUANT_PROJECTIONS_FROM_UNCOPIED,
        };
        let dequant_projections_from = keep(
            &mut problems,
            parse_count(
                get("KESTREL_DEQUANT_PROJECTIONS_FROM"),
                "KESTREL_DEQUANT_PROJECTIONS_FROM",
                0,
                "tokens",
                dequant_default,
            ),
            dequant_default,
        );
        Config {
            problems,
            device,
            kernel_cache_dir,
            cuda_include_dir,
            profile,
            pdl,
            wgmma,
            wide_experts,
            wide_projections,
            fused_attention,
            fused_norm,
            bounded_router,
            decode_split_keys,
            skinny_experts_from,
            dequant_projections_from,
            projection_copies,
        }
    }
}

/// The largest count a counting variable takes.
const MAX_COUNT: usize = 1 << 20;

/// A counting variable (of `unit`) from `min` to `MAX_COUNT`, or `default` when it is unset.
fn parse_count(
    value: Option<&str>,
    var: &'static str,
    min: usize,
    unit: &str,
    default: usize,
) -> std::result::Result<usize, ConfigProblem> {
    let Some(v) = value else { return Ok(default) };
    v.parse::<usize>()
        .ok()
        .filter(|n| (min..=MAX_COUNT).contains(n))
        .ok_or_else(|| ConfigProblem {
            var,
            value: v.to_string(),
            reason: format!("expected a number of {unit} from {min} to {MAX_COUNT}"),
        })
}

fn parse_bool(
    value: Option<&str>,
    var: &'static str,
    default: bool,
) -> std::result::Result<bool, ConfigProblem> {
    let Some(v) = value else { return Ok(default) };
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ConfigProblem {
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
        let c = Config::from_vars(&vars(&[]));
        assert_eq!(c.device, 0);
        assert!(!c.profile);
        assert!(c.pdl);
        assert!(c.check().is_ok() && c.problems.is_empty());
        assert!(!Config::from_vars(&vars(&[("KESTREL_PDL", "off")])).pdl);
        assert!(Config::from_vars(&vars(&[("KESTREL_PDL", "maybe")]))
            .check()
            .is_err());
        assert!(c.wgmma);
        assert!(!Config::from_vars(&vars(&[("KESTREL_WGMMA", "0")])).wgmma);
        assert!(c.wide_experts);
        assert!(!Config::from_vars(&vars(&[("KESTREL_WIDE_EXPERTS", "off")])).wide_experts);
        assert!(c.wide_projections);
        assert!(!Config::from_vars(&vars(&[("KESTREL_WIDE_PROJECTIONS", "off")])).wide_projections);
        assert!(!Config::from_vars(&vars(&[("KESTREL_FUSED_ATTENTION", "no")])).fused_attention);
        assert!(c.fused_attention && Config::default().fused_attention);
        assert_eq!(c.decode_split_keys, 0);
        assert_eq!(
            Config::from_vars(&vars(&[("KESTREL_DECODE_SPLIT_KEYS", "512")])).decode_split_keys,
            512
        );
        for bad in ["-1", "many", "2000000"] {
            let c = Config::from_vars(&vars(&[("KESTREL_DECODE_SPLIT_KEYS", bad)]));
            assert_eq!(c.decode_split_keys, 0);
            assert!(c.check().is_err(), "{bad}");
        }
        assert_eq!(c.skinny_experts_from, SKINNY_EXPERTS_FROM);
        assert_eq!(
            Config::from_vars(&vars(&[("KESTREL_SKINNY_EXPERTS_FROM", "9")])).skinny_experts_from,
            9
        );
        for bad in ["1", "0", "few"] {
            let c = Config::from_vars(&vars(&[("KESTREL_SKINNY_EXPERTS_FROM", bad)]));
            assert_eq!(c.skinny_experts_from, SKINNY_EXPERTS_FROM);
            assert!(c.check().is_err(), "{bad}");
        }
        assert!(!Config::from_vars(&vars(&[("KESTREL_FUSED_NORM", "off")])).fused_norm);
        assert!(c.fused_norm && Config::default().fused_norm);
        assert!(!Config::from_vars(&vars(&[("KESTREL_BOUNDED_ROUTER", "0")])).bounded_router);
        assert!(c.bounded_router && Config::default().bounded_router);
        assert!(!Config::from_vars(&vars(&[("KESTREL_PROJECTION_COPIES", "off")])).projection_copies);
        assert!(c.projection_copies && Config::default().projection_copies);
        assert_eq!(c.dequant_projections_from, DEQUANT_PROJECTIONS_FROM);
        let from = |v| Config::from_vars(&vars(&[("KESTREL_DEQUANT_PROJECTIONS_FROM", v)]));
        assert_eq!(from("0").dequant_projections_from, 0);
        assert_eq!(from("1024").dequant_projections_from, 1024);
        for bad in ["-3", "all", "2000000"] {
            assert_eq!(from(bad).dequant_projections_from, DEQUANT_PROJECTIONS_FROM);
            assert!(from(bad).check().is_err(), "{bad}");
        }
        let uncopied = |v: &[(&str, &str)]| {
            let mut v = v.to_vec();
            v.push(("KESTREL_PROJECTION_COPIES", "off"));
            Config::from_vars(&vars(&v)).dequant_projections_from
        };
        assert_eq!(uncopied(&[]), DEQUANT_PROJECTIONS_FROM_UNCOPIED);
        assert_eq!(uncopied(&[("KESTREL_DEQUANT_PROJECTIONS_FROM", "40")]), 40);
        assert_eq!(c.kernel_cache_dir, None, "no HOME, no XDG_CACHE_HOME: no cache");
    }

    #[test]
    fn cache_dir_follows_xdg_then_home_and_can_be_disabled() {
        let c = Config::from_vars(&vars(&[("HOME", "/home/u")]));
        assert_eq!(
            c.kernel_cache_dir,
            Some(PathBuf::from("/home/u/.cache/kestrel/kernels"))
        );
        let c = Config::from_vars(&vars(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/xdg")]));
        assert_eq!(c.kernel_cache_dir, Some(PathBuf::from("/xdg/kestrel/kernels")));
        let c = Config::from_vars(&vars(&[("HOME", "/home/u"), ("KESTREL_KERNEL_CACHE", "OFF")]));
        assert_eq!(c.kernel_cache_dir, None);
        let c = Config::from_vars(&vars(&[("KESTREL_KERNEL_CACHE", "/tmp/k")]));
        assert_eq!(c.kernel_cache_dir, Some(PathBuf::from("/tmp/k")));
    }

    #[test]
    fn booleans_and_device() {
        let c = Config::from_vars(&vars(&[("KESTREL_PROFILE", "on"), ("KESTREL_DEVICE", " 3 ")]));
        assert!(c.profile);
        assert_eq!(c.device, 3);
        let c = Config::from_vars(&vars(&[("KESTREL_PROFILE", "False")]));
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
        let e = Config::from_vars(&vars(&[("KESTREL_PROFILE", "maybe")]))
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("KESTREL_PROFILE"), "{e}");
        let e = Config::from_vars(&vars(&[("KESTREL_DEVICE", "gpu0")]))
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("KESTREL_DEVICE"), "{e}");
        let e = Config::from_vars(&vars(&[("KESTREL_CUDA_INCLUDE", "/definitely/not/here")]))
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("KESTREL_CUDA_INCLUDE"), "{e}");
    }

    #[test]
    fn a_bad_value_keeps_the_default_and_every_problem() {
        let c = Config::from_vars(&vars(&[
            ("KESTREL_DEVICE", "gpu0"),
            ("KESTREL_PDL", "maybe"),
            ("KESTREL_PROFILE", "on"),
        ]));
        assert_eq!((c.device, c.pdl, c.profile), (0, true, true));
        let vars: Vec<&str> = c.problems.iter().map(|p| p.var).collect();
        assert_eq!(vars, ["KESTREL_DEVICE", "KESTREL_PDL"]);
    }
}
