#!/usr/bin/env bash
# Carries a second kestrel binary (BASE, e.g. main's, for an A/B with scripts/gpu/bench-ab.sh)
# into gpu-bundle/ as a zstd patch against the bundle's own binary, since two stripped binaries
# do not fit a device call's 64 MiB carry and a patch between two builds of nearby commits is
# under 1 MB. Run after scripts/gpu/gpu-bundle.sh; writes gpu-bundle/base.patch, the zstd
# executable and the libraries it links (the GPU host may lack zstd), and
# gpu-bundle/unpack-base.sh, which writes gpu-bundle/kestrel_base on the GPU host.
#
#   bash scripts/gpu/base-patch.sh /path/to/kestrel-of-main
#   (on the GPU host) bash gpu-bundle/unpack-base.sh && bash scripts/gpu/bench-ab.sh \
#       gpu-bundle/kestrel_base gpu-bundle/kestrel 2 logs -- --synthetic qwen3-30b-a3b -p 512 -n 0 -r 3
set -euo pipefail
cd "$(dirname "$0")/../.."
base=$1
out=gpu-bundle
[ -x "$out/kestrel" ] || { echo "no $out/kestrel: run scripts/gpu/gpu-bundle.sh first" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Patch a stripped copy, as the bundle's own binary is stripped.
cp "$base" "$tmp/base"
strip "$tmp/base" 2>/dev/null || true
zstd -q -19 --long=27 --patch-from="$out/kestrel" "$tmp/base" -o "$out/base.patch" -f
mkdir -p "$out/zstd"
cp "$(command -v zstd)" "$out/zstd/"
ldd "$(command -v zstd)" | awk '/=>/ {print $3}' | grep -v -E 'libc\.so|libpthread|libm\.so|ld-linux' |
  while read -r lib; do cp "$lib" "$out/zstd/"; done
cat > "$out/unpack-base.sh" <<'UNPACK'
#!/usr/bin/env bash
# Writes kestrel_base beside this script from base.patch and the bundle's kestrel.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/zstd" "$here/zstd/zstd" -d -q --long=27 --patch-from="$here/kestrel" \
  "$here/base.patch" -o "$here/kestrel_base" -f
chmod +x "$here/kestrel_base"
UNPACK
chmod +x "$out/unpack-base.sh"
ls -la "$out/base.patch"
