#!/usr/bin/env bash
# Unpacks nvJPEG (the header and shared library of the PyPI wheel nvidia-nvjpeg, CUDA 13's
# nvidia/cu13/{include,lib}) into DEST, so that DEST/include/nvjpeg.h and DEST/lib/libnvjpeg.so.13
# exist; the CUDA backend then builds the device's JPEG decoder (src/backend/cuda/
# nvjpeg_decoder.cpp) on toolkits that ship without nvJPEG. Toolkits that have it
# (CUDA::nvjpeg) do not need this.
#   tools/fetch_nvjpeg.sh DEST        (the Makefile passes build/_deps/nvjpeg)
# The wheel comes from $VITGRID_WHEEL_DIR/nvidia_nvjpeg-*.whl when such a file is there
# (machines without network), else from `pip download`. Never fails: without pip, network or
# unzip it prints one line saying the device's JPEG decoder is off and exits 0.
set -u
VERSION=${VITGRID_NVJPEG_VERSION:-13.3.2.43}
DEST=${1:?usage: $0 DEST}
off() { echo "nvjpeg: $* - the device's JPEG decoder is off (build continues without it)"; exit 0; }

[ -f "$DEST/include/nvjpeg.h" ] && ls "$DEST"/lib/libnvjpeg.so* >/dev/null 2>&1 && exit 0

PREFIX=nvidia/cu13
unzip_tree() {  # wheel -> $2/$PREFIX/{include,lib} (python's zipfile when unzip is missing)
  local whl=$1 to=$2
  if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$whl" "$PREFIX/include/*" "$PREFIX/lib/*" -d "$to" >/dev/null 2>&1
  elif command -v python3 >/dev/null 2>&1; then
    python3 - "$whl" "$to" "$PREFIX/" <<'PYEOF' >/dev/null 2>&1
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(sys.argv[3])])
PYEOF
  else
    return 1
  fi
}

whl=""
if [ -n "${VITGRID_WHEEL_DIR:-}" ]; then
  whl=$(ls "$VITGRID_WHEEL_DIR"/nvidia_nvjpeg-*.whl 2>/dev/null | sort | tail -1)
fi
tmp=$(mktemp -d) || off "no temporary directory"
trap 'rm -rf "$tmp"' EXIT
if [ -z "$whl" ]; then
  command -v python3 >/dev/null 2>&1 || off "no python3"
  python3 -m pip --version >/dev/null 2>&1 || off "no pip"
  if ! python3 -m pip download -q --retries 1 --timeout 15 --no-deps --only-binary=:all: \
         "nvidia-nvjpeg==$VERSION" -d "$tmp" >/dev/null 2>&1; then
    off "pip download of nvidia-nvjpeg==$VERSION failed (offline?)"
  fi
  whl=$(ls "$tmp"/nvidia_nvjpeg-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || off "pip download gave no wheel"
fi
unzip_tree "$whl" "$tmp/x" || off "cannot unpack $whl"
[ -f "$tmp/x/$PREFIX/include/nvjpeg.h" ] || off "$(basename "$whl") has no $PREFIX/include/nvjpeg.h"
mkdir -p "$DEST" || off "cannot create $DEST"
rm -rf "$DEST/include" "$DEST/lib"
mv "$tmp/x/$PREFIX/include" "$tmp/x/$PREFIX/lib" "$DEST/" || off "cannot fill $DEST"
echo "nvjpeg: $(basename "$whl") in $DEST (include/, lib/)"
exit 0
