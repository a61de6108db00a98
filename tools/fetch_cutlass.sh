#!/usr/bin/env bash
# Unpacks NVIDIA's header-only CUTLASS / CuTe (the include tree of the PyPI wheel nvidia-cutlass,
# cutlass_library/source/include) into DEST, so that DEST/include/cutlass/cutlass.h exists; the
# CUDA backend then builds its fused GEMM + exact-GELU kernels (src/backend/cuda/gemm_gelu.cu).
#   tools/fetch_cutlass.sh DEST        (the Makefile passes build/_deps/cutlass)
# The wheel comes from $VITGRID_WHEEL_DIR/nvidia_cutlass-*.whl when such a file is there
# (machines without network), else from `pip download`. Never fails: without pip, network or
# unzip it prints one line saying the fused GELU GEMMs are off and exits 0.
set -u
VERSION=${VITGRID_CUTLASS_VERSION:-4.2.0.0}
DEST=${1:?usage: $0 DEST}
off() { echo "cutlass: $* - fused GELU GEMMs are off (build continues without them)"; exit 0; }

[ -f "$DEST/include/cutlass/cutlass.h" ] && exit 0

PREFIX=cutlass_library/source/include
unzip_include() {  # wheel -> $1/$PREFIX (python's zipfile when unzip is missing)
  local whl=$1 to=$2
  if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$whl" "$PREFIX/*" -d "$to" >/dev/null 2>&1
  elif command -v python3 >/dev/null 2>&1; then
    python3 - "$whl" "$to" "$PREFIX/" <<'EOF' >/dev/null 2>&1
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(sys.argv[3])])
EOF
  else
    return 1
  fi
}

tmp=$(mktemp -d) || off "no temporary directory"
trap 'rm -rf "$tmp"' EXIT
whl=""
if [ -n "${VITGRID_WHEEL_DIR:-}" ]; then
  whl=$(ls "$VITGRID_WHEEL_DIR"/nvidia_cutlass-*.whl 2>/dev/null | sort | tail -1)
fi
if [ -z "$whl" ]; then
  command -v python3 >/dev/null 2>&1 || off "no python3"
  python3 -m pip --version >/dev/null 2>&1 || off "no pip"
  if ! python3 -m pip download -q --retries 1 --timeout 15 --no-deps --only-binary=:all: \
         "nvidia-cutlass==$VERSION" -d "$tmp" >/dev/null 2>&1; then
    off "pip download of nvidia-cutlass==$VERSION failed (offline?)"
  fi
  whl=$(ls "$tmp"/nvidia_cutlass-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || off "pip download gave no wheel"
fi
unzip_include "$whl" "$tmp/x" || off "cannot unpack $whl"
[ -f "$tmp/x/$PREFIX/cutlass/cutlass.h" ] || off "$(basename "$whl") has no $PREFIX/cutlass/cutlass.h"
mkdir -p "$DEST" || off "cannot create $DEST"
rm -rf "$DEST/include"
mv "$tmp/x/$PREFIX" "$DEST/include" || off "cannot move the headers into $DEST"
echo "cutlass: headers from $(basename "$whl") in $DEST/include"
exit 0
