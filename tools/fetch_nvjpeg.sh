#!/usr/bin/env bash
# Unpacks nvJPEG (the header and shared library of the PyPI wheel nvidia-nvjpeg, CUDA 13's
# nvidia/cu13/{include,lib}) into DEST, so that DEST/include/nvjpeg.h and DEST/lib/libnvjpeg.so.13
# exist; the CUDA backend then builds the device's JPEG decoder (src/backend/cuda/
# nvjpeg_decoder.cpp) on toolkits that ship without nvJPEG. Toolkits that have it
# (CUDA::nvjpeg) do not need this.
#   tools/fetch_nvjpeg.sh DEST        (the Makefile passes build/_deps/nvjpeg)
# The wheel: $VITGRID_WHEEL_DIR/nvidia_nvjpeg-*.whl, else pip (tools/wheel_fetch.sh). Never
# fails: without pip, network or unzip it says the device's JPEG decoder is off and exits 0.
set -u
source "$(dirname "$0")/wheel_fetch.sh"
wheel_fetch nvjpeg "the device's JPEG decoder is off (build continues without it)" \
  nvidia-nvjpeg "${VITGRID_NVJPEG_VERSION:-13.3.2.43}" "${1:?usage: $0 DEST}" \
  "include/nvjpeg.h lib/libnvjpeg.so*" nvidia/cu13/include:include nvidia/cu13/lib:lib
