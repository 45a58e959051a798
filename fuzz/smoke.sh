#!/usr/bin/env bash
# CI's check of the fuzz targets: builds them (nightly with ASan where it works, else stable),
# seeds the corpora if they are empty, and fuzzes every target for a few seconds
# (KESTREL_FUZZ_SMOKE_SECONDS, default 5). Fails if the build fails or any target crashes; prints
# the toolchain and flags it used, each target's figures and how long it all took.
set -euo pipefail
source "$(dirname "$0")/common.sh"
seconds="${KESTREL_FUZZ_SMOKE_SECONDS:-5}"
start=$(date +%s)

fuzz_pick_toolchain
echo "smoke.sh: fuzzing each of ${#FUZZ_TARGETS[@]} targets for ${seconds}s"
fuzz_describe
build_start=$(date +%s)
mkdir -p "$FUZZ_DIR/target"
if ! fuzz_build >"$FUZZ_DIR/target/build.log" 2>&1; then
    tail -40 "$FUZZ_DIR/target/build.log"
    echo "smoke.sh: FAILED: the fuzz targets do not build (log: fuzz/target/build.log)"
    exit 1
fi
echo "smoke.sh: build took $(($(date +%s) - build_start))s"
"$FUZZ_DIR/seed.sh" >/dev/null

# run.sh picks the same toolchain again without probing, and finds the build up to date.
export KESTREL_FUZZ_TOOLCHAIN="$FUZZ_TOOLCHAIN"
crashed=()
for t in "${FUZZ_TARGETS[@]}"; do
    status=0
    out="$("$FUZZ_DIR/run.sh" "$t" "$seconds" 2>&1)" || status=$?
    # The figures, and for a crash what run.sh says of it; the rest is in fuzz/target/logs.
    grep -E '^(run\.sh: ([a-z_]+ \(|.*CRASHED|artifact:|reproduce|fork mode|kestrel-fuzz)|    )' <<<"$out" || true
    if [ "$status" -ne 0 ]; then
        grep -q 'CRASHED' <<<"$out" || tail -20 <<<"$out"
        crashed+=("$t")
    fi
done

echo "smoke.sh: took $(($(date +%s) - start))s in all ($FUZZ_MODE)"
if [ ${#crashed[@]} -gt 0 ]; then
    echo "smoke.sh: FAILED: ${crashed[*]} (crash artifacts under fuzz/artifacts/, logs under fuzz/target/logs/)"
    exit 1
fi
echo "smoke.sh: no crash in any target"
