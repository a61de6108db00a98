# Thin wrapper around CMake/CTest. The two commands: `make run` and `make test`.
BUILD   ?= build
JOBS    ?= $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
NP      ?= 2
DECK    ?= inputs/quickstart.ini
# each `make run` writes a fresh run directory (a deck's out_dir refuses to hold two runs)
RUN_DIR ?= runs/$(basename $(notdir $(DECK)))-$(shell date +%Y%m%d-%H%M%S)
ARGS    ?=
CMAKE_FLAGS ?=

# Open MPI refuses to run as root unless told; containers and CI run as root.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
SUDO :=
else
SUDO := sudo
endif
# one rank per core: no hidden threads competing with the ranks
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1

APT_PACKAGES := build-essential cmake pkg-config openmpi-bin libopenmpi-dev \
  libhdf5-openmpi-dev hdf5-tools libboost-program-options-dev libopenblas-dev \
  libgtest-dev libbenchmark-dev python3 python3-numpy python3-h5py python3-torch \
  python3-torchvision python3-matplotlib libprotobuf-dev protobuf-compiler python3-protobuf python3-pil \
  python3-crcmod libjpeg62-turbo-dev libpng-dev slurm-wlm slurm-wlm-basic-plugins munge libpmix2

.PHONY: deps pydeps build run test bench format clean help

help:
	@echo "make run    install what is missing, build, train $(DECK) on $(NP) ranks"
	@echo "make test   build and run every test (ctest)"
	@echo "make deps | pydeps | build | bench | format | clean"

deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ -n "$$VITGRID_NO_APT" ]; then echo "missing packages:$$missing (VITGRID_NO_APT set: not installing)"; exit 0; fi; \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing; \
	else echo "deps: all present"; fi
	@# cuDNN fused attention and the fused GELU GEMMs: the header-only cudnn_frontend and
	@# CUTLASS, only where CUDA is (never fails)
	@if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null 2>&1; then \
	  bash tools/fetch_cudnn_frontend.sh $(BUILD)/_deps/cudnn_frontend || true; \
	  bash tools/fetch_cutlass.sh $(BUILD)/_deps/cutlass || true; \
	  bash tools/fetch_nvjpeg.sh $(BUILD)/_deps/nvjpeg || true; fi

# The Python tools' modules for the python3 first on PATH (pyenv, conda, a venv); Debian's
# /usr/bin/python3 gets them from apt above, and a tool that misses a module under another
# python3 runs again under /usr/bin/python3 (tools/tool_deps.py).
pydeps:
	python3 -m pip install -r tools/requirements.txt

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

run: deps build
	mpirun -np $(NP) --oversubscribe $(BUILD)/bin/vitgrid train $(DECK) --run.out_dir=$(RUN_DIR) $(ARGS)

test: deps build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

bench: build
	@for b in $(BUILD)/bin/bench_*; do [ -x $$b ] && $$b --benchmark_min_time=0.2 || true; done

format:
	clang-format -i $$(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD)
