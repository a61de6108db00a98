#!/usr/bin/env bash
# Build, test and measure vitgrid on a GPU node in one go, beside PyTorch + timm.
#   tools/gpu_check.sh STEP...      (default: build test bench)
# Steps: build test cputest bench models loader jpeg decode_overlap recipes kernels fp8 fp8bench compile scale study large
# large2 pipeline tpvitb ckpt recompute seqpar e2epar profile variants trace (each described where it is handled below).
# Writes logs under $OUT (default /tmp/vitgrid-gpu). On a node without parallel HDF5 or
# Boost.ProgramOptions, put their Debian packages in .gpu-deps/ (see README): they are unpacked
# into /opt/deps and used from there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vitgrid-gpu}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1
B=${BUILD:-build-gpu}
CMAKE_EXTRA=()
if [ -d .gpu-deps ] && ls .gpu-deps/*.deb >/dev/null 2>&1; then
  for f in .gpu-deps/*.deb; do dpkg -x "$f" /opt/deps; done
  L=/opt/deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$L:${LD_LIBRARY_PATH:-}
  CMAKE_EXTRA=(-DCMAKE_PREFIX_PATH=/opt/deps/usr -DBoost_ROOT=/opt/deps/usr -DBoost_NO_SYSTEM_PATHS=ON
               -DVITGRID_HDF5_INCLUDE_DIR=/opt/deps/usr/include/hdf5/openmpi
               -DVITGRID_HDF5_LIBRARY=$L/libhdf5_openmpi.so)
fi
# cuDNN's fused attention needs the header-only cudnn_frontend: from a wheel in .gpu-deps/ on
# nodes without network (tools/fetch_cudnn_frontend.sh), else from PyPI
if [ ! -f build/_deps/cudnn_frontend/include/cudnn_frontend.h ]; then
  VITGRID_WHEEL_DIR=$PWD/.gpu-deps tools/fetch_cudnn_frontend.sh /opt/deps/cudnn_frontend
  [ -f /opt/deps/cudnn_frontend/include/cudnn_frontend.h ] &&
    CMAKE_EXTRA+=(-DVITGRID_CUDNN_FRONTEND_DIR=/opt/deps/cudnn_frontend/include)
fi
# the fused GELU GEMMs need the header-only CUTLASS: the same way (tools/fetch_cutlass.sh)
if [ ! -f build/_deps/cutlass/include/cutlass/cutlass.h ]; then
  VITGRID_WHEEL_DIR=$PWD/.gpu-deps tools/fetch_cutlass.sh /opt/deps/cutlass
  [ -f /opt/deps/cutlass/include/cutlass/cutlass.h ] &&
    CMAKE_EXTRA+=(-DVITGRID_CUTLASS_DIR=/opt/deps/cutlass/include)
fi
PY=$(command -v python3)
# The large ViT (bf16, activation checkpointing, global batch 32) under each layout given, on
# 4 GPUs: large_layouts LOGNAME LAYOUT...
# JPEG_DECODES / RECIPE_DECODES entries (host, device, device:SHARE, auto; /host or /device
# after one: data.resize) as deck overrides in X
decode_args() {
  local d=${1%%/*}
  X=(--data.decode=${d%%:*})
  [[ $d == *:* ]] && X+=(--data.device_share=${d#*:})
  [[ $1 == */* ]] && X+=(--data.resize=${1#*/})
  return 0
}
large_layouts() {
  local log=$1; shift
  [ "$NGPU" -ge 4 ] || return 0
  local L=(inputs/bench_vit_b16.ini --model.preset=vit-huge-4096 --model.checkpoint_activations=true
           --data.global_batch=32 --precision.mode=bf16 --warmup=1 --steps=3)
  for lay in "$@"; do
    echo "layout: $lay"
    mpirun -np 4 --bind-to none "$B/bin/vitgrid" bench "${L[@]}" $lay 2>&1 | grep -E "^bench|bubble|error"
  done | tee "$OUT/$log.log"
}
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(build test bench)
NGPU=$(nvidia-smi -L | wc -l)
# the data sets the loader, jpeg and recipes steps make and read; the cores per GPU
D=${DATA:-/tmp/vitgrid-data}
CORES=$(( $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / (NGPU > 0 ? NGPU : 1) ))
for s in "${steps[@]}"; do
  case $s in
  build)
    cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DVITGRID_CUDA=ON -DVG_PYTHON3="$PY" \
      "${CMAKE_EXTRA[@]}" >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
    # BUILD_TARGET=vitgrid builds the application only (no tests, no kernel benchmarks; several
    # targets: BUILD_TARGET="vitgrid bench_gpu_kernels")
    cmake --build "$B" -j "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" --target ${BUILD_TARGET:-all} >"$OUT/build.log" 2>&1 ||
      { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
    echo "build ok"
    ;;
  test)
    (cd "$B" && ctest -L gpu --output-on-failure --timeout 600) >"$OUT/test_gpu.log" 2>&1
    grep -E "tests passed|Failed|Passed|Skipped|\*\*\*" "$OUT/test_gpu.log" | tail -15
    # the end-to-end checks' own lines (layout, measured difference, bound)
    grep -hE "^(ok|FAIL|skip) " "$B/Testing/Temporary/LastTest.log" | tee "$OUT/test_gpu_checks.log"
    ;;
  cputest)
    (cd "$B" && ctest -LE gpu -j 8 --timeout 600) >"$OUT/test_cpu.log" 2>&1
    grep -E "tests passed|Failed" "$OUT/test_cpu.log" | tail -10
    ;;
  bench)
    # vitgrid and PyTorch side by side: ViT-B/16, 224 px, batch 256 per GPU (the deck times
    # cuBLASLt's candidates per GEMM shape: device.gemm_tune = 8; the first line is without)
    {
      mpirun -np 1 "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --device.gemm_tune=0 --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
      for p in ${PRECISIONS:-bf16 fp16}; do
        mpirun -np 1 "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --precision.mode=$p --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
      done
    } | tee "$OUT/bench_vitgrid.log"
    for p in ${PRECISIONS:-bf16 fp16}; do
      "$PY" tools/bench_pytorch.py --precision $p 2>&1 | grep -E "^pytorch|Error"
    done | tee "$OUT/bench_pytorch.log"
    "$PY" tools/bench_pytorch.py --precision bf16 --compile 2>&1 | grep -E "^pytorch|Error" | tee -a "$OUT/bench_pytorch.log"
    ;;
  models)
    # the small models, where launch overhead weighs: ViT-S/16 (224 px, batch 256) and
    # ViT-Lite-7/4 (32 px, batch 512), bf16, vitgrid beside PyTorch eager and torch.compile
    {
      mpirun -np 1 "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --model.preset=vit-small/16 \
        --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
      mpirun -np 1 "$B/bin/vitgrid" bench inputs/cifar10_vit_lite_7_4.ini --data.dataset=synthetic \
        --data.global_batch=512 --device.gemm_tune=8 --device.deterministic=false \
        --model.keep_gelu_output=true --warmup=10 --steps=50 2>&1 | grep -E "^bench|error"
      for c in "" --compile; do
        "$PY" tools/bench_pytorch.py --model vit_small_patch16_224 --precision bf16 $c 2>&1 | grep -E "^pytorch|Error"
        "$PY" tools/bench_pytorch.py --model vit_lite_7_4 --img 32 --classes 10 --batch 512 \
          --precision bf16 --steps 50 $c 2>&1 | grep -E "^pytorch|Error"
      done
    } | tee "$OUT/models.log"
    ;;
  loader)
    # the input pipeline on its own, one rank with the node's cores per GPU: synthetic 224 px,
    # HDF5 224 px (written first), CIFAR-10 binary 32 px (random records in its format)
    mkdir -p "$D/cifar"
    "$B/bin/vitgrid_dataset" synthetic "$D/syn224" --train 4096 --eval 256 --size 224 \
      --classes 1000 --seed 1 >/dev/null
    "$PY" - "$D/cifar" <<'PYEOF'
import os, sys, numpy as np
r = np.random.default_rng(0)
for n in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
    rec = r.integers(0, 256, size=(10000, 3073), dtype=np.uint8)
    rec[:, 0] %= 10
    rec.tofile(os.path.join(sys.argv[1], n))
PYEOF
    {
      echo "synthetic 224 px:"; "$B/bin/bench_loader" inputs/bench_vit_b16.ini --batches=40 2>&1 | tail -2
      echo "hdf5 224 px:"; "$B/bin/bench_loader" inputs/bench_vit_b16.ini --data.dataset=hdf5 \
        --data.path="$D/syn224_train.h5" --data.eval_path="$D/syn224_eval.h5" --batches=40 2>&1 | tail -2
      echo "cifar10 32 px (crop, flip, mixup):"; "$B/bin/bench_loader" inputs/cifar10_vit_lite_7_4.ini \
        --data.path="$D/cifar" --batches=100 2>&1 | tail -2
    } | tee "$OUT/loader.log"
    ;;
  variants)
    # A/B: the bench deck once per ';'-separated argument list in VARIANTS on NP ranks, global
    # batch GB (default 256 per rank), 20 steps unless a variant says otherwise, e.g.
    #   VARIANTS="--device.deterministic=true; --device.deterministic=false" gpu_check.sh variants
    # Each word of a variant is a deck override (--section.key=value: every vitgrid tuning
    # choice is a deck key, e.g. --device.fused_gelu=off --device.bucket_mb=0), except a
    # NAME=value word of an NCCL_* variable, which sets it for that variant only (NCCL_*
    # variables set for the call reach every rank).
    n=${NP:-1}
    IFS=';' read -ra VS <<<"${VARIANTS:-}"
    mapfile -t XS < <(env | grep -oE '^NCCL_[A-Z_]+' | sed 's/^/-x\n/')
    for v in "${VS[@]}"; do
      VX=() VA=()
      for w in $v; do
        if [[ $w =~ ^NCCL_[A-Z_]+= ]]; then VX+=(-x "$w"); else VA+=("$w"); fi
      done
      echo "variant:$v $(env | grep -E '^NCCL_' | grep -v NVLS | tr '\n' ' ')"
      mpirun -np "$n" --bind-to none "${XS[@]}" "${VX[@]}" "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini \
        --data.global_batch=${GB:-$((256 * n))} --warmup=5 --steps=20 "${VA[@]}" 2>&1 | grep -E "^bench|error" |
        sed -E 's/ \| (world|zero|allocs)[^|]*//g'
    done | tee -a "$OUT/variants.log"
    ;;
  compile)
    "$PY" tools/bench_pytorch.py --precision fp16 --compile 2>&1 | grep -E "^pytorch|Error" | tee -a "$OUT/bench_pytorch.log"
    ;;
  scale)
    # data-parallel efficiency: 256 images per GPU at 1..NGPU GPUs, vitgrid and DDP
    for n in ${SCALE_N:-1 2 4 8}; do
      [ "$n" -le "$NGPU" ] || continue
      mpirun -np $n --bind-to none "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini \
        --data.global_batch=$((256 * n)) --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
      "$PY" -m torch.distributed.run --nproc_per_node $n tools/bench_pytorch.py --ddp --precision bf16 2>&1 | grep -E "^pytorch|Error"
    done | tee "$OUT/scale.log"
    # ZeRO-1 and overlap on the node's GPUs: memory and step time
    if [ "$NGPU" -ge 2 ] && [ "${SCALE_EXTRA:-1}" = 1 ]; then
      for z in 1; do
        mpirun -np "$NGPU" --bind-to none "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini \
          --data.global_batch=$((256 * NGPU)) --parallel.zero=$z --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
      done
      mpirun -np "$NGPU" --bind-to none "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini \
        --data.global_batch=$((256 * NGPU)) --device.bucket_mb=0 --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
    fi | tee -a "$OUT/scale.log"
    ;;
  study)
    # data-parallel scaling with the user's tool: each GPU alone first (the slowest sets the
    # data-parallel pace), then every GPU at once without communication (what being all busy
    # costs), then 1 and all GPUs, with SM clocks and board power (nvidia-smi)
    "$PY" tools/scaling_study.py inputs/bench_vit_b16.ini --bin "$B/bin/vitgrid" --ranks 1 "$NGPU" \
      --each-device --together --clocks --steps ${STUDY_STEPS:-60} -o "$OUT/study.md" 2>&1 | tail -20
    ;;
  large)
    # the large ViT (hidden 4096, depth 32, heads 64, 224/16), bf16, no recomputation, on 4 GPUs:
    # the README's layouts, each "BATCH|LAYOUT" (SP = 1d with sequence parallelism);
    # LARGE_PRECISIONS="bf16 fp8": each layout in each; LARGE_CASES=n: the first n layouts only
    [ "$NGPU" -ge 4 ] || { echo "large: needs 4 GPUs"; continue; }
    SP="--parallel.tensor_mode=1d --parallel.sequence_parallel=true"
    n=0
    for c in "128|--parallel.tensor=2 $SP --parallel.zero=1 --parallel.sequence_chunks=1" \
             "128|--parallel.tensor=4 $SP" "64|--parallel.tensor=4 $SP" \
             "128|--parallel.tensor=2 $SP --parallel.pipeline=2 --parallel.schedule=interleaved --parallel.chunks=2 --parallel.micro_batches=2" \
             "64|--parallel.tensor=2 $SP --parallel.pipeline=2 --parallel.schedule=interleaved --parallel.chunks=2 --parallel.micro_batches=2" \
             "64|--parallel.tensor=2 $SP --parallel.pipeline=2 --parallel.micro_batches=8" \
             "64|--parallel.tensor=2 $SP --parallel.zero=1" "64|--parallel.zero=1"; do
      n=$((n + 1)); [ "$n" -le "${LARGE_CASES:-99}" ] || break
      for p in ${LARGE_PRECISIONS:-bf16}; do
        echo "batch ${c%%|*}, $p: ${c#*|}"
        mpirun -np 4 --bind-to none "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --model.preset=vit-huge-4096 \
          --precision.mode=$p --warmup=3 --steps=8 --data.global_batch=${c%%|*} ${c#*|} 2>&1 | grep -E "^bench|bubble|error"
      done
    done | tee "$OUT/large.log"
    ;;
  large2)
    # the large ViT on 2 GPUs: 1d tensor 2 and 2 pipeline stages (1F1B, M = 8)
    [ "$NGPU" -ge 2 ] || { echo "large2: needs 2 GPUs"; continue; }
    L2=(inputs/bench_vit_b16.ini --model.preset=vit-huge-4096 --model.checkpoint_activations=true
        --data.global_batch=32 --precision.mode=bf16 --warmup=4 --steps=6)
    for v in "--parallel.tensor=2 --parallel.tensor_mode=1d" \
             "--parallel.pipeline=2 --parallel.micro_batches=8"; do
      echo "layout: $v"
      mpirun -np 2 --bind-to none "$B/bin/vitgrid" bench "${L2[@]}" $v 2>&1 |
        grep -E "^bench|bubble per|error"
    done | tee "$OUT/large2.log"
    ;;
  recompute)
    # partial activation checkpointing (model.checkpoint_blocks): ViT-B/16 bf16 256 on one GPU
    # with every block, 9, 6, 3 of the 12 and none recomputed; with 2 GPUs, the large ViT in 1d
    # tensor 2 with 32 (every block), 16 and none of its 32 blocks recomputed
    V=(inputs/bench_vit_b16.ini --precision.mode=bf16 --warmup=5 --steps=20)
    for n in -1 9 6 3 off; do
      c=(--model.checkpoint_activations=true --model.checkpoint_blocks=$n)
      [ "$n" = off ] && c=()
      echo "ViT-B/16, one GPU, checkpoint_blocks $n"
      mpirun -np 1 --bind-to none "$B/bin/vitgrid" bench "${V[@]}" "${c[@]}" 2>&1 | grep -E "^bench|rror"
    done | tee "$OUT/recompute.log"
    if [ "$NGPU" -ge 2 ]; then
      L2=(inputs/bench_vit_b16.ini --model.preset=vit-huge-4096 --data.global_batch=32
          --precision.mode=bf16 --warmup=3 --steps=6 --parallel.tensor=2 --parallel.tensor_mode=1d)
      for n in -1 16 off; do
        c=(--model.checkpoint_activations=true --model.checkpoint_blocks=$n)
        [ "$n" = off ] && c=()
        echo "large ViT, 1d t2, checkpoint_blocks $n"
        mpirun -np 2 --bind-to none "$B/bin/vitgrid" bench "${L2[@]}" "${c[@]}" 2>&1 | grep -E "^bench|rror"
      done | tee -a "$OUT/recompute.log"
    fi
    ;;
  seqpar)
    # 1d sequence parallelism (parallel.sequence_parallel) against plain 1d, tensor 2 on 2
    # GPUs: ViT-L/16 and ViT-B/16 at 256, the large ViT at batch 32 without and with activation
    # checkpointing. Sequence parallel: its collectives overlapped through copy engines (the
    # default) and through NCCL's SM kernels
    [ "$NGPU" -ge 2 ] || { echo "seqpar: needs 2 GPUs"; continue; }
    T2=(inputs/bench_vit_b16.ini --precision.mode=bf16 --parallel.tensor=2 --parallel.tensor_mode=1d)
    for m in "--model.preset=vit-large/16 --data.global_batch=256 --warmup=5 --steps=20" \
             "--data.global_batch=256 --warmup=5 --steps=20" \
             "--model.preset=vit-huge-4096 --data.global_batch=32 --warmup=4 --steps=6" \
             "--model.preset=vit-huge-4096 --data.global_batch=32 --warmup=4 --steps=6 --model.checkpoint_activations=true"; do
      for v in "plain:--parallel.sequence_parallel=false" \
               "sp_copy_engine:--parallel.sequence_parallel=true" \
               "sp_sm:--parallel.sequence_parallel=true --device.tensor_comm=sm"; do
        [ -n "${SEQPAR_QUICK:-}" ] && [ "${v%%:*}" = sp_sm ] && [ "${m#*vit-huge}" != "$m" ] &&
          continue
        echo "${v%%:*}: $m"
        mpirun -np 2 --bind-to none "$B/bin/vitgrid" bench "${T2[@]}" $m ${v#*:} \
          2>&1 | grep -E "^bench|rror"
      done
    done | tee "$OUT/seqpar.log"
    ;;
  pipeline)
    # the large ViT under pipeline parallelism on 4 GPUs: per schedule, images/s, MFU, the
    # bubble measured from device events beside the schedule's theory, memory per GPU
    large_layouts pipeline \
      "--parallel.pipeline=2 --parallel.micro_batches=4 --parallel.tensor=2 --parallel.tensor_mode=1d" \
      "--parallel.pipeline=4 --parallel.micro_batches=8" \
      "--parallel.pipeline=4 --parallel.micro_batches=8 --parallel.schedule=gpipe" \
      "--parallel.pipeline=4 --parallel.micro_batches=8 --parallel.schedule=interleaved --parallel.chunks=2"
    ;;
  tpvitb)
    # ViT-B/16 in 1d tensor parallelism against data parallelism at the same global batch
    # (256 images per GPU), and tensor x data on 4 GPUs
    for n in 2 4; do
      [ "$n" -le "$NGPU" ] || continue
      for lay in "" "--parallel.tensor=$n --parallel.tensor_mode=1d" \
                 "--parallel.tensor=2 --parallel.tensor_mode=1d"; do
        [ "$lay" = "--parallel.tensor=2 --parallel.tensor_mode=1d" ] && [ "$n" -ne 4 ] && continue
        echo "gpus $n layout: ${lay:-data parallel}"
        mpirun -np $n --bind-to none "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini \
          --data.global_batch=$((256 * n)) $lay --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
      done
    done | tee "$OUT/tp_vitb.log"
    ;;
  ckpt)
    # checkpoints of ViT-B/16 data-parallel and of the large ViT in 1d t4 on the node's GPUs
    # (at most 4): `vitgrid bench --checkpoint` in each mode of CKPT_MODES (sync-hdf5: written
    # before the step loop goes on, through HDF5's collective writes; sync-direct: the same
    # with checkpoint.direct_io; async: in the background with direct_io, the default on GPUs),
    # each line with the step loop's stall, the file's rate and the disk's own (dd-like O_DIRECT
    # probe, same directory, same bytes); MODE:T with checkpoint.direct_threads = T. CKPT_READ=1
    # adds a train / resume pair (read rate).
    R=${RUNS:-/tmp/vitgrid-ckpt}
    rm -rf "$R"; mkdir -p "$R"
    n=$NGPU; [ "$n" -le 4 ] || n=4
    V=(--run.log_every=1 --run.eval_samples=64 --data.synthetic_eval=64)
    for c in "vitb|--data.global_batch=$((64 * n))" \
             "large|--model.preset=vit-huge-4096 --model.checkpoint_activations=true --data.global_batch=8 --parallel.tensor=$n --parallel.tensor_mode=1d"; do
      name=${c%%|*}; lay=${c#*|}
      [[ " ${CKPT_MODELS:-vitb large} " == *" $name "* ]] || continue
      echo "checkpoint $name ($n GPUs): $lay"
      if [ "${CKPT_READ:-0}" = 1 ]; then
        mpirun -np $n --bind-to none "$B/bin/vitgrid" train inputs/bench_vit_b16.ini "${V[@]}" $lay \
          --run.out_dir="$R/$name" --run.steps=1 2>&1 | grep -E "checkpoint .*(written|loaded)|rror"
        mpirun -np $n --bind-to none "$B/bin/vitgrid" train inputs/bench_vit_b16.ini "${V[@]}" $lay \
          --run.out_dir="$R/$name" --run.steps=2 --checkpoint.resume=auto --checkpoint.keep=1 2>&1 | grep -E "checkpoint .*(written|loaded)|rror"
        rm -rf "$R/$name"
      fi
      for mode in ${CKPT_MODES:-sync-hdf5 sync-direct async}; do
        case ${mode%%:*} in
          sync-hdf5) M=(--checkpoint.async=false --checkpoint.direct_io=false) ;;
          sync-direct) M=(--checkpoint.async=false --checkpoint.direct_io=true) ;;
          async) M=(--checkpoint.async=true --checkpoint.direct_io=true) ;;
        esac
        # MODE:T: checkpoint.direct_threads = T
        [[ $mode == *:* ]] && M+=(--checkpoint.direct_threads=${mode#*:})
        mpirun -np $n --bind-to none "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini $lay "${M[@]}" \
          --warmup=1 --steps=${CKPT_STEPS:-10} --checkpoint --run.out_dir="$R/$name" 2>&1 |
          grep -E "^checkpoint bench|rror" | sed "s/^/$name $mode: /"
        rm -rf "$R/$name"
      done
    done | tee "$OUT/ckpt.log"
    ;;
  e2epar)
    (cd "$B" && ctest -R "e2e_gpu_parallel|e2e_gpu_resume|e2e_gpu_data_comm|gpu_mpi_tp|gpu_nccl|gpu_zero_nccl" --output-on-failure --timeout 600) >"$OUT/test_par.log" 2>&1
    grep -E "tests passed|Failed" "$OUT/test_par.log" | tail -4
    grep -hE "^(ok|FAIL|skip) " "$B/Testing/Temporary/LastTest.log"
    ;;
  kernels)
    # the CUDA backend's kernels at ViT-B/16 shapes (Google Benchmark)
    "$B/bin/bench_gpu_kernels" --benchmark_min_time=0.1s --benchmark_filter="${KERNELS:-.}" 2>&1 \
      | grep -E "^BM_|^-|Benchmark" | tee "$OUT/kernels.log"
    ;;
  fp8)
    # FP8's ops against the CPU's emulation (gpu_fp8: casts bit for bit, GEMMs within the FP8
    # accumulator's bound, the FP8 Linear layer), then the FP8 GEMMs, casts and layer beside the
    # bf16 Linear's (BUILD_TARGET="gpu_fp8 bench_gpu_kernels" is enough for this step)
    (cd "$B" && ctest -R "^gpu_fp8$" -V --timeout 300) >"$OUT/fp8.log" 2>&1
    grep -E "tests passed|\[  (FAILED|  OK) \]|largest difference" "$OUT/fp8.log"
    "$B/bin/bench_gpu_kernels" --benchmark_min_time=0.1s \
      --benchmark_filter='BM_(Fp8Linear|Fp8LinearLayer|Fp8Cast|LinearForward|LinearBackward|LinearWgrad/.*/tune:1)' 2>&1 \
      | grep -E "^BM_|Benchmark" | tee "$OUT/fp8_kernels.log"
    ;;
  fp8bench)
    # precision.mode = fp8 beside bf16: ViT-S/16, ViT-B/16 and ViT-L/16 at batch 256 (vitgrid),
    # torch.compile bf16 and torch.compile + torchao's float8 training (tensorwise; its wheel
    # from .gpu-deps/ where the node has none), the op profiles of ViT-B/16's step in both, the
    # loss curves of 300 ViT-S/16 steps, and ViT-Lite-7/4 trained 30 epochs on a generated 32 px
    # set of 10 classes in each precision (final top-1). Attention: FP8_ATTENTION (default
    # cudnn_forward, the faster at T = 197), and ViT-B/16 fp8 with auto beside it, and with
    # precision.fp8_fast_accum_dgrad (its 300 ViT-S/16 steps too)
    ATT=--device.attention=${FP8_ATTENTION:-cudnn_forward}
    # 300 ViT-S/16 steps into a fresh DIR: s16_steps DIR OVERRIDE...
    s16_steps() {
      local dir=$1; shift
      rm -rf "$dir"
      mpirun -np 1 "$B/bin/vitgrid" train inputs/bench_vit_b16.ini --model.preset=vit-small/16 \
        --run.steps=300 --run.log_every=100 --run.eval_every=0 --device.gemm_tune=0 \
        --run.out_dir="$dir" "$@" 2>&1 | grep -E "rror"
    }
    {
      for m in vit-small/16 vit-base/16 vit-large/16; do
        for p in bf16 fp8; do
          mpirun -np 1 "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --model.preset=$m \
            --precision.mode=$p $ATT --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
        done
      done
      mpirun -np 1 "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --precision.mode=fp8 \
        --device.attention=auto --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
      echo "ViT-B/16 fp8, precision.fp8_fast_accum_dgrad = true:"
      mpirun -np 1 "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --precision.mode=fp8 $ATT \
        --precision.fp8_fast_accum_dgrad=true --warmup=5 --steps=20 2>&1 | grep -E "^bench|error"
      if ! "$PY" -c "import torchao" 2>/dev/null && ls .gpu-deps/torchao-*.whl >/dev/null 2>&1; then
        "$PY" -m pip install --no-deps -q .gpu-deps/torchao-*.whl >/dev/null 2>&1
      fi
      for f in "" --float8; do
        "$PY" tools/bench_pytorch.py --precision bf16 --compile $f 2>&1 | grep -E "^pytorch|Error|needs"
      done
      for p in bf16 fp8; do
        mpirun -np 1 "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --precision.mode=$p $ATT --profile 2>&1 \
          | grep -E "^\||^profile"
        s16_steps "$D/s16-$p" --precision.mode=$p
        rm -rf "$D/lite-$p"
        mpirun -np 1 --bind-to none "$B/bin/vitgrid" train inputs/cifar10_vit_lite_7_4.ini \
          --data.dataset=synthetic --data.synthetic_train=20000 --data.synthetic_eval=5000 \
          --model.num_classes=10 --run.epochs=30 --optim.warmup_epochs=5 --run.eval_every=0 \
          --checkpoint.every_steps=0 --checkpoint.resume=none --data.workers=$CORES \
          --precision.mode=$p --run.out_dir="$D/lite-$p" 2>&1 | grep -E "^eval|rror" | tail -1
      done
      s16_steps "$D/s16-fp8-dgrad" --precision.mode=fp8 --precision.fp8_fast_accum_dgrad=true
      "$PY" tools/compare_losses.py "$D/s16-bf16" "$D/s16-fp8"
      "$PY" tools/compare_losses.py "$D/s16-bf16" "$D/s16-fp8-dgrad"
    } | tee "$OUT/fp8bench.log"
    ;;
  trace)
    # kernel timelines (tools/ktrace, CUPTI; build it: BUILD_TARGET="vitgrid vitgrid_ktrace"):
    # the bench deck on 1 GPU and on the node's GPUs (data parallel), then tools/ktrace_report.py
    # compares them: busy and idle time, NCCL kernels alone or overlapped, kernel classes
    K=$B/lib/libvitgrid_ktrace.so
    [ -f "$K" ] || { echo "trace: $K not built (no CUPTI in the CUDA toolkit?)"; continue; }
    for n in 1 "$NGPU"; do
      rm -rf "$OUT/trace$n" && mkdir -p "$OUT/trace$n"
      VITGRID_KTRACE=$OUT/trace$n mpirun -np "$n" --bind-to none -x LD_PRELOAD="$K" -x VITGRID_KTRACE \
        "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --data.global_batch=$((256 * n)) \
        --warmup=5 --steps=${TRACE_STEPS:-20} ${TRACE_ARGS:-} 2>&1 | grep -E "^bench|error|ktrace"
    done
    "$PY" tools/ktrace_report.py "$OUT/trace$NGPU" --compare "$OUT/trace1" | tee "$OUT/trace_report.log"
    ;;
  profile)
    mpirun -np 1 "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --precision.mode=bf16 --profile 2>&1 \
      | grep -E "^\||^bench|^profile|rror" | tee "$OUT/profile.log"
    ;;
  jpeg)
    # Real-image input: an ImageNet-like set of photo-like JPEGs (tools/make_jpeg_dataset.py,
    # JPEG_N train images, mean ~400 x 350 px, q90) as an ImageFolder tree, packed (jpeg_h5) and
    # as TFRecord shards (test/data/write_tfrecord.py); the input pipeline alone (one rank, the
    # node's cores per GPU) on the host and on the device, beside torchvision's DataLoader and
    # GPU decode_jpeg; then training from the JPEGs against the same model on synthetic data.
    N=${JPEG_N:-20000}
    if [ ! -d "$D/jpeg/train" ]; then
      "$PY" tools/make_jpeg_dataset.py "$D/jpeg" --train "$N" --val $((N / 10)) --classes 100 2>&1 | tail -1
      "$B/bin/vitgrid_dataset" pack "$D/jpeg" "$D/jpeg.h5" 2>&1 | tail -1
      # the independent writer needs python protobuf and a CRC32C: wheels from .gpu-deps where
      # this python lacks them, kept apart from its own packages
      TPY=()
      if ! "$PY" -c "import google.protobuf; import crcmod" 2>/dev/null && ls .gpu-deps/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-deps --no-index --find-links .gpu-deps --target /opt/deps/py protobuf crc32c 2>&1 | tail -1
        TPY=(env PYTHONPATH=/opt/deps/py)
      fi
      "${TPY[@]}" "$PY" test/data/write_tfrecord.py "$D/jpeg" "$D/jpeg-tfr" --shards 16 --val-shards 2 2>&1 | tail -1
    fi
    # source jpeg_h5_256 (JPEG_INPUT_SOURCES / JPEG_TRAIN_SOURCES): the set packed with
    # --short-side 256 (images resized to a shorter side of 256, re-encoded at quality 90)
    if [[ " ${JPEG_INPUT_SOURCES:-} ${JPEG_TRAIN_SOURCES:-} " == *" jpeg_h5_256 "* ]] &&
       [ ! -f "$D/jpeg256_train.h5" ]; then
      "$B/bin/vitgrid_dataset" pack "$D/jpeg" "$D/jpeg256.h5" --short-side 256 --threads $CORES 2>&1 | tail -2
    fi
    J=(--model.num_classes=100 --data.hflip=true --data.interpolation=bilinear --data.workers=$CORES)
    if [[ " ${JPEG_PARTS:-input train} " == *" input "* ]]; then
      for src in ${JPEG_INPUT_SOURCES:-folder tfrecord jpeg_h5}; do
        case $src in folder) set -- folder "$D/jpeg" ;; tfrecord) set -- tfrecord "$D/jpeg-tfr" ;;
          jpeg_h5) set -- jpeg_h5 "$D/jpeg.h5" ;; jpeg_h5_256) set -- jpeg_h5 "$D/jpeg256.h5" ;; esac
        # host decoding with the resize on the host's threads and on the device; nvJPEG
        for where in "host --resize=host" "host --resize=device" "device"; do
          "$B/bin/bench_loader" inputs/bench_vit_b16.ini --data.dataset=$1 --data.path=$2 \
            --data.index_dir="$D/idx" "${J[@]}" --decode=$where --batches=${JPEG_BATCHES:-60} 2>&1 | grep -E "^input|rror"
        done
      done
      "$PY" tools/bench_input_peers.py "$D/jpeg/train" --workers $CORES 2>&1 | grep -E "^peer|Error"
    fi | tee "$OUT/jpeg_input.log"
    # training: the same model on the JPEG set (decoded on the device) and on one batch reused
    # (vitgrid bench: the model alone, no input pipeline), 256 images per GPU, on 1 GPU and on
    # all of the node's
    NPS="1"; [ "$NGPU" -gt 1 ] && NPS="1 $NGPU"
    NPS=${JPEG_NPS:-$NPS}  # the GPU counts to train on (default: 1 and all of the node's)
    if [[ " ${JPEG_PARTS:-input train} " == *" train "* ]]; then
      for np in $NPS; do
        G=(--data.global_batch=$((256 * np)))
        for m in ${JPEG_MODELS:-vit-base/16 vit-base/32}; do
          mpirun -np $np --bind-to none "$B/bin/vitgrid" bench inputs/bench_vit_b16.ini --model.preset=$m \
            --model.num_classes=100 "${G[@]}" --warmup=5 --steps=30 2>&1 | grep -E "^bench|rror" | sed "s/^/$np GPU | /"
          # JPEG_DECODES: host, device (all on the GPU) or device:SHARE (data.device_share),
          # each with /host or /device: data.resize
          for src in ${JPEG_TRAIN_SOURCES:-folder}; do
            S=$src
            case $src in folder) P=$D/jpeg ;; jpeg_h5) P=$D/jpeg.h5 ;; tfrecord) P=$D/jpeg-tfr ;;
              jpeg_h5_256) P=$D/jpeg256.h5; S=jpeg_h5 ;; esac
            for dec in ${JPEG_DECODES:-host device device:0.3}; do
              decode_args "$dec"
              mpirun -np $np --bind-to none "$B/bin/vitgrid" train inputs/bench_vit_b16.ini --model.preset=$m \
                --data.dataset=$S --data.path=$P --data.index_dir="$D/idx" "${J[@]}" "${G[@]}" "${X[@]}" \
                --run.steps=${JPEG_STEPS:-50} --run.out_dir="$D/run-$src" \
                --run.eval_samples=512 --checkpoint.every_steps=0 2>&1 | grep -E "rror" | head -2
              "$PY" tools/run_rate.py "$D/run-$src/metrics.h5" --skip 10 --label "$np GPU | $m $src $dec"
              rm -rf "$D/run-$src"
            done
          done
        done
      done
    fi | tee "$OUT/jpeg_train.log"
    ;;
  decode_overlap)
    # nvJPEG's hardware decode beside a GEMM load, stand-alone (tools/bench_decode_overlap.cu;
    # also its hybrid split decoder and libjpeg-turbo on 1, 8 and 16 threads: "split", "turbo")
    # on the JPEG step's set (made here if missing: 2,048 images); DECODE_VARIANTS="a|b" runs only
    # the variants whose names hold one of the parts (e.g. "alone|pools")
    [ -d "$D/jpeg/train" ] || "$PY" tools/make_jpeg_dataset.py "$D/jpeg-small" --train 2048 --val 16 --classes 16 2>&1 | tail -1
    DIR=$D/jpeg/train; [ -d "$DIR" ] || DIR=$D/jpeg-small/train
    nvcc -std=c++17 -O2 -arch=sm_90 tools/bench_decode_overlap.cu -o "$B/bin/bench_decode_overlap" \
      -lcublas -lnvjpeg -lcuda -ljpeg && "$B/bin/bench_decode_overlap" "$DIR" ${DECODE_VARIANTS:+"$DECODE_VARIANTS"} \
      | tee "$OUT/decode_overlap.log"
    ;;
  recipes)
    # Colossal-AI's three LAMB 32K recipes (inputs/imagenet_vit_*_lamb_32k.ini: fp16, Mixup,
    # RandomResizedCrop + flip, 32768 images per step through accumulation) on all of the node's
    # GPUs, reading the ImageNet-like set of the jpeg step as TFRecord shards (as Colossal-AI's
    # DALI loader reads ImageNet): RECIPE_STEPS optimizer steps each, the rate of all but the
    # first, and the projected wall time of 300 epochs of ImageNet-1k (1,281,167 images).
    # RECIPE_DECODES: as JPEG_DECODES (default: the decks' own, data.decode = auto).
    # RECIPE_SOURCE=folder reads the ImageFolder tree instead (the same batches).
    RP=$D/jpeg-tfr RS=()
    [ "${RECIPE_SOURCE:-tfrecord}" = folder ] && RP=$D/jpeg RS=(--data.dataset=folder)
    [ -d "$RP" ] || { echo "recipes: run the jpeg step first (it writes $RP)"; exit 1; }
    for r in ${RECIPES:-b32 b16 l32}; do
      for dec in ${RECIPE_DECODES:-auto}; do
        decode_args "$dec"
        mpirun -np "$NGPU" --bind-to none "$B/bin/vitgrid" train inputs/imagenet_vit_${r}_lamb_32k.ini \
          "${RS[@]}" --data.path="$RP" --data.index_dir="$D/idx" --model.num_classes=100 \
          --data.grad_accum=$((32768 / (256 * NGPU))) --data.workers=$CORES "${X[@]}" \
          --run.epochs=0 --run.steps=${RECIPE_STEPS:-4} --run.log_every=1 --run.eval_samples=512 \
          --run.out_dir="$D/recipe-$r" --checkpoint.every_steps=0 --checkpoint.resume=none 2>&1 | grep -E "rror" | head -2
        "$PY" tools/run_rate.py "$D/recipe-$r/metrics.h5" --skip 1 --label "$NGPU GPU | recipe $r $dec" --epochs 300 --images 1281167
        rm -rf "$D/recipe-$r"
      done
    done | tee "$OUT/recipes.log"
    ;;
  *) echo "unknown step $s"; exit 2 ;;
  esac
done
