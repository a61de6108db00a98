#!/usr/bin/env bash
# Unpacks NVIDIA's header-only CUTLASS / CuTe (the include tree of the PyPI wheel nvidia-cutlass,
# cutlass_library/source/include) into DEST, so that DEST/include/cutlass/cutlass.h exists; the
# CUDA backend then builds its fused GEMM + exact-GELU kernels (src/backend/cuda/gemm_gelu.cu).
#   tools/fetch_cutlass.sh DEST        (the Makefile passes build/_deps/cutlass)
# The wheel: $VITGRID_WHEEL_DIR/nvidia_cutlass-*.whl, else pip (tools/wheel_fetch.sh). Never
# fails: without pip, network or unzip it says the fused GELU GEMMs are off and exits 0.
set -u
source "$(dirname "$0")/wheel_fetch.sh"
wheel_fetch cutlass "fused GELU GEMMs are off (build continues without them)" \
  nvidia-cutlass "${VITGRID_CUTLASS_VERSION:-4.2.0.0}" "${1:?usage: $0 DEST}" \
  "include/cutlass/cutlass.h" cutlass_library/source/include:include
