#!/usr/bin/env bash
# Builds Kestrel's test binaries and CLI here (a machine with Rust) and collects them into
# gpu-bundle/ (the GPU tests alone, with the fixtures they read under gpu-bundle/root/), which
# a GPU host with no Rust toolchain runs from any directory with `bash gpu-bundle/run.sh`.
#
#   scripts/gpu/gpu-bundle.sh        # build and collect
#   bash gpu-bundle/run.sh [LOGDIR]  # on the GPU host: every test with KESTREL_REQUIRE_GPU=1,
#                                    # then `kestrel doctor`; logs go to LOGDIR if given
set -euo pipefail
cd "$(dirname "$0")/../.."
out=gpu-bundle
rm -rf "$out"
mkdir -p "$out/tests" "$out/root"

cargo build --release --workspace
# One JSON line per artifact; keep the test executables.
cargo test --release --workspace --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])
' | while read -r exe; do
  name=$(basename "$exe")
  name=${name%-*}
  # Only what touches the GPU travels (the device call carries at most 64 MiB): integration
  # tests whose source names CUDA, and the CUDA crate's unit tests; not the CLI tests, which
  # run the binary at its path here.
  if [ "$name" = kestrel_cuda ] || [ "$name" = kestrel_cuda_rt ] ||
    { [[ $name != cli_* ]] && grep -qi cuda crates/*/tests/"$name".rs 2>/dev/null; }; then
    cp "$exe" "$out/tests/$name"
    # The fixtures the test reads (kestrel_testing::fixtures::path("...") in it or the
    # crate's tests/common), copied under root/ at the same relative paths.
    for src in crates/*/tests/"$name".rs; do
      [ -f "$src" ] || continue
      { grep -ho 'fixtures::path("[^"]*")' "$src" "$(dirname "$src")"/common/*.rs 2>/dev/null || true; } |
        sed 's/.*("\(.*\)")/\1/'
    done
  fi
done | sort -u | while read -r fixture; do
  mkdir -p "$out/root/$(dirname "$fixture")"
  cp -r "$fixture" "$out/root/$fixture"
done
cp target/release/kestrel "$out/kestrel"
strip "$out/kestrel" "$out"/tests/* 2>/dev/null || true

cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs every collected test binary with a GPU required, one test at a time (timing tests must
# not share the GPU with other tests), then `kestrel doctor`. Exit status: failed binaries.
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:-}
# Fixtures are read relative to the bundle, wherever it was copied.
export KESTREL_REQUIRE_GPU=1 KESTREL_TEST_ROOT="$here/root"
failed=0
for t in "$here"/tests/*; do
  name=$(basename "$t")
  echo "=== $name"
  if [ -n "$logs" ]; then
    "$t" --test-threads=1 2>&1 | tee "$logs/test-$name.log"; rc=${PIPESTATUS[0]}
  else
    "$t" --test-threads=1; rc=$?
  fi
  [ "$rc" -eq 0 ] || { echo "FAILED: $name (exit $rc)"; failed=$((failed + 1)); }
done
echo "=== kestrel doctor"
"$here/kestrel" doctor || failed=$((failed + 1))
echo "test binaries and doctor failed: $failed"
exit "$failed"
RUN
chmod +x "$out/run.sh"
du -sh "$out"
ls -la "$out" "$out/tests"
