#!/usr/bin/env bash
# Unpacks NVIDIA's header-only cudnn_frontend (the include/ folder of the PyPI wheel
# nvidia-cudnn-frontend) into DEST, so that DEST/include/cudnn_frontend.h exists; the CUDA
# backend then builds its cuDNN fused-attention path (src/backend/cuda/cudnn_attention.cpp).
#   tools/fetch_cudnn_frontend.sh DEST        (the Makefile passes build/_deps/cudnn_frontend)
# The wheel comes from $VITGRID_WHEEL_DIR/nvidia_cudnn_frontend-*.whl when such a file is there
# (machines without network), else from `pip download`. Never fails: without pip, network or
# unzip it prints one line saying the cuDNN SDPA path is off and exits 0.
set -u
VERSION=${VITGRID_CUDNN_FRONTEND_VERSION:-1.32.0}
DEST=${1:?usage: $0 DEST}
off() { echo "cudnn_frontend: $* - cuDNN SDPA attention is off (build continues without it)"; exit 0; }

[ -f "$DEST/include/cudnn_frontend.h" ] && exit 0

unzip_include() {  # wheel -> DEST/include (python's zipfile when unzip is missing)
  local whl=$1
  if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$whl" 'include/*' -d "$DEST" >/dev/null 2>&1
  elif command -v python3 >/dev/null 2>&1; then
    python3 - "$whl" "$DEST" <<'EOF' >/dev/null 2>&1
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
EOF
  else
    return 1
  fi
}

whl=""
if [ -n "${VITGRID_WHEEL_DIR:-}" ]; then
  whl=$(ls "$VITGRID_WHEEL_DIR"/nvidia_cudnn_frontend-*.whl 2>/dev/null | sort | tail -1)
fi
tmp=""
if [ -z "$whl" ]; then
  command -v python3 >/dev/null 2>&1 || off "no python3"
  python3 -m pip --version >/dev/null 2>&1 || off "no pip"
  tmp=$(mktemp -d) || off "no temporary directory"
  trap 'rm -rf "$tmp"' EXIT
  if ! python3 -m pip download -q --retries 1 --timeout 15 --no-deps --only-binary=:all: \
         "nvidia-cudnn-frontend==$VERSION" -d "$tmp" >/dev/null 2>&1; then
    off "pip download of nvidia-cudnn-frontend==$VERSION failed (offline?)"
  fi
  whl=$(ls "$tmp"/nvidia_cudnn_frontend-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || off "pip download gave no wheel"
fi
mkdir -p "$DEST" || off "cannot create $DEST"
unzip_include "$whl" || off "cannot unpack $whl"
if [ -f "$DEST/include/cudnn_frontend.h" ]; then
  echo "cudnn_frontend: headers from $(basename "$whl") in $DEST/include"
else
  off "$(basename "$whl") has no include/cudnn_frontend.h"
fi
exit 0
