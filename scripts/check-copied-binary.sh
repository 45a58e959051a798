#!/usr/bin/env bash
# Shows that an installed or copied `kestrel` needs no checkout: clones this repository's HEAD
# into a temporary folder, builds the release binary there, copies it out, deletes the clone
# (so no path compiled into the binary exists any more) and runs the README's main command on
# the built-in model from another directory. Runs here (needs Rust; no GPU).
#
#   bash scripts/check-copied-binary.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone --quiet "$repo" "$tmp/clone"
(cd "$tmp/clone" && cargo build --release --quiet)
mkdir -p "$tmp/elsewhere/bin" "$tmp/elsewhere/work"
cp "$tmp/clone/target/release/kestrel" "$tmp/elsewhere/bin/kestrel"
rm -rf "$tmp/clone"
cd "$tmp/elsewhere/work"
echo "clone deleted; running $tmp/elsewhere/bin/kestrel from $(pwd)"
"$tmp/elsewhere/bin/kestrel" run --backend cpu -p "What does os.path.join do?" -n 48
