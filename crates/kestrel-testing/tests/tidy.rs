//! The house rules a reader relies on, checked on the sources: within a crate no two files
//! import each other, directly or through others (a file's `use crate::…` / `use super::…`
//! and inline `crate::…` / `super::…` paths are its imports; a parent declaring its child
//! modules is not); and no command of the CLI imports from another command's file (shared
//! flags live in `args.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src` (`ops/moe.rs` → `ops::moe`, `ops/mod.rs` → `ops`,
/// `lib.rs` → ``).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let parts: Vec<&str> = parts
        .iter()
        .map(String::as_str)
        .filter(|p| !matches!(*p, "mod" | "lib" | "main"))
        .collect();
    parts.join("::")
}

/// The known modules a path names from `base` on: the longest prefix of `rest` that is a
/// module, and for a `{a, b::c}` group each item's first name that is one.
fn named(base: &[String], rest: &str, modules: &BTreeSet<String>, found: &mut BTreeSet<String>) {
    let mut path = base.to_vec();
    let mut best = None;
    for seg in rest.split("::") {
        let name: String = seg
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            if let Some(group) = seg.strip_prefix('{') {
                let group = group.split('}').next().unwrap_or("");
                for item in group.split(',') {
                    let first = item.trim().split("::").next().unwrap_or("").trim();
                    let mut p = path.clone();
                    p.push(first.to_string());
                    if modules.contains(&p.join("::")) {
                        found.insert(p.join("::"));
                    }
                }
            }
            break;
        }
        path.push(name);
        if modules.contains(&path.join("::")) {
            best = Some(path.join("::"));
        } else {
            break;
        }
    }
    if let Some(m) = best {
        found.insert(m);
    }
}

/// The modules of the crate a file refers to.
fn imports(text: &str, this: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let own: Vec<String> = this
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let parent = own[..own.len().saturating_sub(1)].to_vec();
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    for (prefix, base) in [("crate::", Vec::new()), ("super::", parent)] {
        for (i, _) in code.match_indices(prefix) {
            let before = code[..i].chars().last();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            named(&base, &code[i + prefix.len()..], modules, &mut found);
        }
    }
    found.remove(this);
    found
}

/// A cycle in `edges`, if any, as the modules along it.
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            match state.get(m.as_str()) {
                Some(1) => {
                    let start = stack.iter().position(|s| s == m).unwrap();
                    let mut c = stack[start..].to_vec();
                    c.push(m.clone());
                    return Some(c);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(m, edges, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if !state.contains_key(n.as_str()) {
            if let Some(c) = visit(n, edges, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// Each crate's file-level import graph: (crate folder, module → modules it imports).
fn graphs() -> Vec<(String, BTreeMap<String, BTreeSet<String>>)> {
    let crates = kestrel_testing::fixtures::path("crates");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&crates).unwrap() {
        let src = entry.unwrap().path().join("src");
        if !src.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let modules: BTreeSet<String> = files.iter().map(|f| module_of(&src, f)).collect();
        let mut edges = BTreeMap::new();
        for f in &files {
            let this = module_of(&src, f);
            let text = std::fs::read_to_string(f).unwrap();
            edges.insert(this.clone(), imports(&text, &this, &modules));
        }
        out.push((src.parent().unwrap().display().to_string(), edges));
    }
    assert!(
        out.len() >= 8,
        "found only {} crates under {}",
        out.len(),
        crates.display()
    );
    out
}

#[test]
fn no_two_files_of_a_crate_import_each_other() {
    for (krate, edges) in graphs() {
        if let Some(c) = cycle(&edges) {
            panic!("{krate}: files import each other in a loop: {}", c.join(" -> "));
        }
    }
}

#[test]
fn no_command_imports_another_commands_file() {
    // The CLI's shared modules; every other file is one command's.
    let shared = ["", "args", "out", "progress", "stats"];
    let (_, edges) = graphs()
        .into_iter()
        .find(|(k, _)| k.ends_with("kestrel"))
        .expect("the CLI crate");
    // `bench` dispatches to its own parts, `bench_model` and `bench_ops`.
    let own_part = |a: &str, b: &str| a == "bench" && b.starts_with("bench_");
    for (file, uses) in &edges {
        if shared.contains(&file.as_str()) {
            continue;
        }
        for u in uses {
            assert!(
                shared.contains(&u.as_str()) || own_part(file, u),
                "command module {file} imports from command module {u}"
            );
        }
    }
}

#[test]
fn the_checker_sees_loops_and_groups() {
    let modules: BTreeSet<String> = ["a", "b", "ops", "ops::x", "ops::common"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut edges = BTreeMap::new();
    edges.insert("a".to_string(), imports("use crate::b::Thing;", "a", &modules));
    edges.insert(
        "b".to_string(),
        imports("fn f() { crate::a::g() }", "b", &modules),
    );
    assert_eq!(cycle(&edges).map(|c| c.len()), Some(3));
    edges.insert("b".to_string(), BTreeSet::new());
    assert_eq!(cycle(&edges), None);
    let x = imports("use super::{common, x};\n// crate::a::y", "ops::x", &modules);
    assert_eq!(x.into_iter().collect::<Vec<_>>(), vec!["ops::common".to_string()]);
    let o = imports("use super::x::Y;", "ops::y", &modules);
    assert_eq!(o.into_iter().collect::<Vec<_>>(), vec!["ops::x".to_string()]);
}
