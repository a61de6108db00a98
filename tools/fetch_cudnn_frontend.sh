#!/usr/bin/env bash
# Unpacks NVIDIA's header-only cudnn_frontend (the include/ folder of the PyPI wheel
# nvidia-cudnn-frontend) into DEST, so that DEST/include/cudnn_frontend.h exists; the CUDA
# backend then builds its cuDNN fused-attention path (src/backend/cuda/cudnn_attention.cpp).
#   tools/fetch_cudnn_frontend.sh DEST        (the Makefile passes build/_deps/cudnn_frontend)
# The wheel: $VITGRID_WHEEL_DIR/nvidia_cudnn_frontend-*.whl, else pip (tools/wheel_fetch.sh).
# Never fails: without pip, network or unzip it says the cuDNN SDPA path is off and exits 0.
set -u
source "$(dirname "$0")/wheel_fetch.sh"
wheel_fetch cudnn_frontend "cuDNN SDPA attention is off (build continues without it)" \
  nvidia-cudnn-frontend "${VITGRID_CUDNN_FRONTEND_VERSION:-1.32.0}" "${1:?usage: $0 DEST}" \
  "include/cudnn_frontend.h" include:include
