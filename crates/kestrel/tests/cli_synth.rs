//! `kestrel synth` refuses, before building any weights, a destination that holds anything and
//! a configuration it does not know. (Writing itself is `kestrel-model`'s `write_model_dir`,
//! tested there: a full configuration's single layer is 700 MB, too much for every test run.)

use std::process::Command;

fn synth(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .arg("synth")
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn bad_destinations_and_names_are_refused() {
    let dir = std::env::temp_dir().join(format!("kestrel-synth-taken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("mine.txt"), "keep").unwrap();
    let (ok, err) = synth(&["qwen3-30b-a3b", "--out", dir.to_str().unwrap()]);
    assert!(!ok && err.contains("not empty"), "{err}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    let (ok, err) = synth(&["qwen9", "--out", "/nonexistent/x"]);
    assert!(!ok && err.contains("qwen3-30b-a3b"), "{err}");
    let (ok, err) = synth(&["qwen3-30b-a3b", "--bits", "3", "--out", "/nonexistent/x"]);
    assert!(!ok && err.contains("4 or 8"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
