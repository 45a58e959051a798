//! Every kernel of the op modules keeps the programmatic-launch contract of `pdl.cuh` (in
//! kestrel-cuda-rt), since the encoder marks all their dispatches programmatic: each
//! `extern "C" __global__` function waits (`pdl_wait()` or `pdl_begin()`, directly or through a
//! device function that does) before any `return`. Read from the sources, so it runs without a
//! GPU. (`runtime.cu` holds the runtime's own test kernels, some of which break the contract on
//! purpose.) The contract's one exception, an idle block leaving without waiting
//! (`PDL_LEAVE_IDLE`), is allowed only in the functions listed here, each of which has a block
//! that always waits.

struct Func<'a> {
    kernel: bool,
    name: &'a str,
    body: &'a str,
}

/// Index of the bracket closing the one at `open`.
fn matching(s: &[u8], open: usize, (l, r): (u8, u8)) -> usize {
    let mut depth = 0;
    for (i, &c) in s.iter().enumerate().skip(open) {
        if c == l {
            depth += 1;
        } else if c == r {
            depth -= 1;
            if depth == 0 {
                return i;
            }
        }
    }
    panic!("unbalanced {}", l as char);
}

/// Function definitions (kernels and device functions) of a CUDA source.
fn functions(src: &str) -> Vec<Func<'_>> {
    let b = src.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'#';
    let mut out = Vec::new();
    for (kernel, key) in [(true, "extern \"C\" __global__"), (false, "__device__")] {
        for (start, _) in src.match_indices(key) {
            let mut i = start + key.len();
            // The first `name(` after the keyword that is not `__launch_bounds__(...)`.
            let (name, open) = loop {
                let Some(p) = src[i..].find('(').map(|p| p + i) else {
                    break ("", usize::MAX);
                };
                let end = src[..p].trim_end().len();
                let begin = src[..end].rfind(|c: char| !ident(c as u8)).map_or(0, |q| q + 1);
                let name = &src[begin..end];
                if name == "__launch_bounds__" || name == "__cluster_dims__" {
                    i = matching(b, p, (b'(', b')')) + 1;
                    continue;
                }
                break (name, p);
            };
            if open == usize::MAX || src[start..open].contains([';', '{', '=']) {
                continue;
            }
            let close = matching(b, open, (b'(', b')'));
            let rest = src[close + 1..].trim_start_matches([' ', '\t', '\n', '\\']);
            if !rest.starts_with('{') {
                continue;
            }
            let brace = src.len() - rest.len();
            let end = matching(b, brace, (b'{', b'}'));
            out.push(Func {
                kernel,
                name,
                body: &src[brace..=end],
            });
        }
    }
    out
}

/// Where `body` first calls one of `callees` (a name followed by `(` or `<`), if anywhere.
fn first_call(body: &str, callees: &[&str]) -> Option<usize> {
    callees
        .iter()
        .filter_map(|c| {
            body.match_indices(c).find_map(|(i, _)| {
                let before = body[..i]
                    .chars()
                    .last()
                    .is_some_and(|p| p.is_alphanumeric() || p == '_');
                let after = body[i + c.len()..].trim_start();
                (!before && (after.starts_with('(') || after.starts_with('<'))).then_some(i)
            })
        })
        .min()
}

#[test]
fn every_op_kernel_waits_before_it_returns() {
    let mut kernels = 0;
    let mut bad = Vec::new();
    // The sources as the binary embeds them, so the test needs no checkout.
    for module in kestrel_cuda::MODULES {
        if module.name == "runtime" {
            continue;
        }
        let file = format!("{}.cu", module.name);
        let src = module.source;
        let funcs = functions(src);
        let waits_first = |body: &str, callees: &[&str]| {
            first_call(body, callees).is_some_and(|i| !body[..i].contains("return"))
        };
        // Device functions that wait before returning, callable in a kernel's place.
        let mut waiting = vec!["pdl_wait", "pdl_begin"];
        let helpers: Vec<&str> = funcs
            .iter()
            .filter(|f| !f.kernel && waits_first(f.body, &["pdl_wait", "pdl_begin"]))
            .map(|f| f.name)
            .collect();
        waiting.extend(helpers);
        for f in funcs.iter().filter(|f| f.kernel) {
            kernels += 1;
            if !waits_first(f.body, &waiting) {
                bad.push(format!("{file}: {}", f.name));
            }
        }
    }
    assert!(
        kernels >= 39,
        "found only {kernels} kernels: the parser missed some"
    );
    assert!(bad.is_empty(), "kernels that do not wait first: {bad:?}");
}

/// Functions whose idle blocks leave without waiting (`pdl.cuh`'s `PDL_LEAVE_IDLE`), and why a
/// block of their grid always waits.
const LEAVE_IDLE: [(&str, &str); 1] = [(
    "decode_attention",
    "split 0 of each (KV head, z) holds the token's first key, so it always has work and waits",
)];

#[test]
fn only_the_listed_functions_leave_idle_and_they_still_wait() {
    let mut seen = Vec::new();
    for module in kestrel_cuda::MODULES {
        if module.name == "runtime" {
            continue;
        }
        for f in functions(module.source) {
            if !f.body.contains("PDL_LEAVE_IDLE") {
                continue;
            }
            assert!(
                LEAVE_IDLE.iter().any(|(name, _)| *name == f.name),
                "{}.cu: {} leaves idle blocks without waiting but is not in LEAVE_IDLE",
                module.name,
                f.name
            );
            assert!(
                first_call(f.body, &["pdl_wait", "pdl_begin"]).is_some(),
                "{}.cu: {} never waits",
                module.name,
                f.name
            );
            seen.push(f.name);
        }
    }
    for (name, _) in LEAVE_IDLE {
        assert!(
            seen.contains(&name),
            "{name} no longer leaves idle: drop it from LEAVE_IDLE"
        );
    }
}

#[test]
fn the_parser_sees_what_it_must() {
    let src = r#"
__device__ void helper(float* x) { if (x) return; pdl_wait(); }
__device__ void good(float* x) { pdl_wait(); pdl_trigger(); x[0] = 1; }
extern "C" __global__ void __launch_bounds__(128, 2) a(float* x) { good(x); }
extern "C" __global__ void __cluster_dims__(8, 1, 1) b(float* x) { if (!x) return; pdl_begin(); }
#define K(N) extern "C" __global__ void k_##N(float* x) { \
        helper(x);                                         \
    }
"#;
    let f = functions(src);
    let names: Vec<&str> = f.iter().map(|f| f.name).collect();
    assert_eq!(names, ["a", "b", "k_##N", "helper", "good"]);
    assert!(first_call(f[0].body, &["good"]).is_some());
    assert!(f[1].body[..first_call(f[1].body, &["pdl_begin"]).unwrap()].contains("return"));
    assert!(f[3].body[..first_call(f[3].body, &["pdl_wait"]).unwrap()].contains("return"));
}
