#!/usr/bin/env bash
# Fuzzes one target for a while: `fuzz/run.sh TARGET SECONDS [libFuzzer flags...]`. Builds the
# targets if needed, seeds the corpus if it is empty, runs libFuzzer on fuzz/corpus/TARGET with
# crashes written to fuzz/artifacts/TARGET/, then prints the executions, exec/s, coverage and any
# crash with its artifact. Exits 1 on a crash. The whole libFuzzer log is kept in
# fuzz/target/logs/TARGET.log.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [ $# -lt 2 ] || ! [[ "$2" =~ ^[0-9]+$ ]]; then
    echo "usage: fuzz/run.sh TARGET SECONDS [libFuzzer flags...]   (targets: ${FUZZ_TARGETS[*]})" >&2
    exit 2
fi
target="$1"
seconds="$2"
shift 2
if ! fuzz_is_target "$target"; then
    echo "run.sh: no target $target (targets: ${FUZZ_TARGETS[*]})" >&2
    exit 2
fi

# libFuzzer's bounds. The process may hold 4 GiB: the chat-template targets leave a parked
# thread behind each render a bound stopped (about 1.3 MiB under ASan; see the README), and ASan
# roughly doubles what the parsers hold. One input may take 10 s (a render stops at 2 s).
RSS_LIMIT_MB="${KESTREL_FUZZ_RSS_LIMIT_MB:-4096}"
TIMEOUT_S="${KESTREL_FUZZ_TIMEOUT_S:-10}"

fuzz_pick_toolchain
fuzz_describe
mkdir -p "$FUZZ_DIR/target"
build_log="$FUZZ_DIR/target/build.log"
if ! fuzz_build >"$build_log" 2>&1; then
    tail -40 "$build_log" >&2
    echo "run.sh: the fuzz targets do not build (log: $build_log)" >&2
    exit 1
fi
grep -E '^(warning|error)' "$build_log" >&2 || true
bin="$FUZZ_BIN_DIR/$target"

corpus="$FUZZ_DIR/corpus/$target"
if [ -z "$(find "$corpus" -type f -print -quit 2>/dev/null)" ]; then
    "$FUZZ_DIR/seed.sh" "$target"
fi
artifacts="$FUZZ_DIR/artifacts/$target"
logs="$FUZZ_DIR/target/logs"
mkdir -p "$artifacts" "$logs"
log="$logs/$target.log"
# The safetensors_index target writes its directory under TMPDIR: one per run, removed after.
scratch="$FUZZ_DIR/target/tmp/$target.$$"
mkdir -p "$scratch"
trap 'rm -rf "$scratch"' EXIT

flags=(-max_total_time="$seconds" -rss_limit_mb="$RSS_LIMIT_MB" -timeout="$TIMEOUT_S"
    -artifact_prefix="$artifacts/" -print_final_stats=1 -dict="$(fuzz_dict "$target")")
# Each render of a chat template that a bound stops leaves a thread parked for good, so a
# template target's process only grows. Its allocations look like a leak to libFuzzer, whose
# leak check then stops the world for every such input (about 0.1 s, which finds nothing: the
# parked thread still reaches them), so the template targets run without it. A long run of one
# goes in fork mode: libFuzzer runs it in child processes of at most 300 s each and starts
# another when one passes the RSS limit (a timeout or crash in a child still ends the run).
fork=0
case "$target" in
    chat_template | tokenizer_config)
        flags+=(-detect_leaks=0)
        if [ "$seconds" -gt 600 ] && ! [[ " $* " == *" -fork="* ]]; then
            fork=1
            flags+=(-fork=1 -ignore_ooms=1 -ignore_timeouts=0 -ignore_crashes=0)
            echo "run.sh: a run of over 600 s: fork mode, so that the threads of stopped renders go with" \
                "their child process (an OOM of a child is counted, not fatal; see the README)"
        fi
        ;;
esac
flags+=("$@")
echo "run.sh: $target for ${seconds}s: $bin ${flags[*]} $corpus"
status=0
TMPDIR="$scratch" "$bin" "${flags[@]}" "$corpus" >"$log" 2>&1 || status=$?

# The last status line (`#N ... cov: C ft: F corp: K/S ...`, in fork mode `#N: cov: ...`) and
# the final statistics (in fork mode only each child's: there the status line has the totals).
# The log holds inputs' bytes, so it is read as text whatever it holds (`grep -a`).
last="$(grep -aE '^#[0-9]+.*cov: ' "$log" | tail -1 || true)"
final_stat() { [ "$fork" -eq 1 ] || sed -n "s/^stat::$1: *//p" "$log" | tail -1; }
field() { sed -n "s|.* $1: \([^ ]*\).*|\1|p" <<<"$last"; }
runs="$(final_stat number_of_executed_units)"
runs="${runs:-$(sed -n 's/^#\([0-9]*\).*/\1/p' <<<"$last")}"
rate="$(final_stat average_exec_per_sec)"
# Fork mode's status line gives the last job's rate: the average is the runs over the time.
elapsed="$(field time)"
[ -z "$rate" ] && [ -n "$runs" ] && [ -n "$elapsed" ] && rate=$((runs / ${elapsed%s}))
rss="$(final_stat peak_rss_mb)"
echo "run.sh: $target ($FUZZ_MODE): executions ${runs:-?}, exec/s ${rate:-?}, coverage $(field cov) edges," \
    "$(field ft) features, corpus $(field corp), peak rss ${rss:-n/a in fork mode} MB"
ooms="$(field oom/timeout/crash)"
[ -n "$ooms" ] && echo "run.sh: fork mode: oom/timeout/crash $ooms (children's OOM inputs: $artifacts/oom-*)"
grep -aE '^kestrel-fuzz: ' "$log" | tail -1 | sed 's/^/run.sh: /' || true

# In fork mode libFuzzer exits with the last child's status, an ignored OOM's included; a
# finding is a child's log it prints in full.
if [ "$fork" -eq 1 ] && [ "$status" -ne 0 ] && ! grep -aq 'INFO: log from the inner process' "$log"; then
    echo "run.sh: fork mode: the last child ended with status $status, an OOM it ignores"
    status=0
fi

if [ "$status" -ne 0 ]; then
    echo "run.sh: $target CRASHED (libFuzzer exit status $status); the log's end:"
    grep -anE 'ERROR|panicked at|SUMMARY|^ *#[0-9]+ 0x|Test unit written|Base64' "$log" | head -40 | sed 's/^/    /'
    artifact="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)"
    echo "run.sh: artifact: ${artifact:-none written} (full log: $log)"
    echo "run.sh: reproduce with: $bin $artifact"
    exit 1
fi
echo "run.sh: $target: no crash (log: $log)"
