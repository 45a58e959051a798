# Sourced by run.sh, smoke.sh and seed.sh: the fuzz folder's paths, the choice of toolchain and
# instrumentation (nightly with AddressSanitizer where it works, else stable without a
# sanitizer), and the build of the fuzz targets into fuzz/target.

FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
FUZZ_TARGETS=(safetensors gguf safetensors_index config_json generation_config tokenizer_config tokenizer_json chat_template cli_flags openai_request)

# The instrumentation cargo-fuzz passes: libFuzzer's coverage counters and comparison tracing,
# and `cfg(fuzzing)`. Debug assertions and overflow checks come from the release profile in
# fuzz/Cargo.toml.
FUZZ_COVERAGE_FLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cforce-frame-pointers=yes"

# Whether `rustc +nightly` builds and runs a program under AddressSanitizer here.
fuzz_nightly_asan_works() {
    local probe
    probe="$(mktemp -d)" || return 1
    printf 'fn main() { let v = vec![1u8; 4]; std::process::exit(i32::from(v[3]) - 1); }\n' >"$probe/p.rs"
    local ok=1
    if rustc +nightly -Zsanitizer=address -o "$probe/p" "$probe/p.rs" >/dev/null 2>&1 && "$probe/p"; then
        ok=0
    fi
    rm -rf "$probe"
    return $ok
}

# Sets FUZZ_TOOLCHAIN, FUZZ_MODE, FUZZ_RUSTFLAGS, FUZZ_HOST and FUZZ_BIN_DIR. KESTREL_FUZZ_TOOLCHAIN
# (nightly or stable) forces a choice; by default nightly with ASan when it works, else stable.
fuzz_pick_toolchain() {
    local want="${KESTREL_FUZZ_TOOLCHAIN:-auto}"
    case "$want" in
        auto)
            if fuzz_nightly_asan_works; then want=nightly; else want=stable; fi
            ;;
        nightly | stable) ;;
        *)
            echo "KESTREL_FUZZ_TOOLCHAIN=$want: expected nightly or stable" >&2
            return 1
            ;;
    esac
    FUZZ_TOOLCHAIN="$want"
    if [ "$want" = nightly ]; then
        FUZZ_MODE="nightly-asan"
        FUZZ_RUSTFLAGS="$FUZZ_COVERAGE_FLAGS -Zsanitizer=address"
    else
        FUZZ_MODE="stable"
        FUZZ_RUSTFLAGS="$FUZZ_COVERAGE_FLAGS"
    fi
    FUZZ_HOST="$(rustc +"$want" -vV | sed -n 's/^host: //p')"
    # One target folder per toolchain and flags, so switching does not rebuild the other.
    FUZZ_BIN_DIR="$FUZZ_DIR/target/$FUZZ_MODE/$FUZZ_HOST/release"
}

# A line saying which toolchain and flags the build uses.
fuzz_describe() {
    local version
    version="$(rustc +"$FUZZ_TOOLCHAIN" --version)"
    if [ "$FUZZ_MODE" = nightly-asan ]; then
        echo "toolchain: $version, with AddressSanitizer"
    elif [ "${KESTREL_FUZZ_TOOLCHAIN:-auto}" = stable ]; then
        echo "toolchain: $version, no sanitizer (stable chosen by KESTREL_FUZZ_TOOLCHAIN)"
    else
        echo "toolchain: $version, no sanitizer (nightly with ASan did not work here)"
    fi
    echo "RUSTFLAGS: $FUZZ_RUSTFLAGS"
}

# Builds every fuzz target (cargo does nothing when they are up to date). `--target` keeps the
# instrumentation off build scripts and proc macros, as cargo-fuzz does.
fuzz_build() {
    RUSTFLAGS="$FUZZ_RUSTFLAGS" CARGO_TARGET_DIR="$FUZZ_DIR/target/$FUZZ_MODE" \
        cargo +"$FUZZ_TOOLCHAIN" build --release --manifest-path "$FUZZ_DIR/Cargo.toml" \
        --target "$FUZZ_HOST" --bins -j 2
}

# Whether `$1` is one of the fuzz targets.
fuzz_is_target() {
    local t
    for t in "${FUZZ_TARGETS[@]}"; do
        [ "$t" = "$1" ] && return 0
    done
    return 1
}

# The libFuzzer dictionary of target `$1` (fuzz/dict/): tokens of its input's syntax and numbers
# at the edges of the types it is read into, which mutation alone reaches slowly.
fuzz_dict() {
    case "$1" in
        safetensors) echo "$FUZZ_DIR/dict/safetensors.dict" ;;
        gguf) echo "$FUZZ_DIR/dict/gguf.dict" ;;
        chat_template) echo "$FUZZ_DIR/dict/chat_template.dict" ;;
        cli_flags) echo "$FUZZ_DIR/dict/cli_flags.dict" ;;
        *) echo "$FUZZ_DIR/dict/json.dict" ;;
    esac
}
