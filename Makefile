# tdist: two commands do all the set-up on a fresh Debian 12 machine.
#   make demo   install what is missing, build, run the main job;
#               ARGS="..." is appended to its command line (fashion_mnist's
#               flags: make demo ARGS=--quiet, ARGS=--all-ranks)
#   make test   install what is missing, build and run the whole test suite
#               twice: against LibTorch 1.13 (Debian, C++17) and against
#               LibTorch 2.x (the torch wheel from PyPI, C++20)
# Also: make build | build-2 | test-1.13 | test-2 | test-gpu | demo-gpt | bench | etcd | asan | tsan | fuzz | clean

# LibTorch 1.13 from Debian's libtorch-dev, C++17 (also what make demo uses)
BUILD      ?= build
# LibTorch 2.x from the torch wheel in .venv, C++20
BUILD2     ?= build-torch2
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
# Expanded when a recipe runs, after `deps` may have installed ninja.
GENERATOR   = $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
CTEST      := ctest -j $(JOBS) --output-on-failure --timeout 300

.PHONY: all deps deps-torch2 deps-pyref configure build build-2 test test-1.13 test-2 test-gpu demo demo-gpt bench slow-link etcd etcd-stop asan tsan fuzz clean

all: build

deps:
	@bash scripts/install-deps.sh

deps-torch2: deps
	@bash scripts/torch2.sh install

# What the tests check tdist's files against (safetensors, in .venv).
deps-pyref: deps
	@bash scripts/python-ref.sh install

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# LibTorch 2.x: the pinned torch wheel (scripts/torch2.sh) in .venv. The
# nccl backend is required (ON, not AUTO): torch2.sh installed NCCL beside
# torch, so a configure that cannot find it stops instead of leaving the
# backend and nccl_test out. The prefix is read first: a torch2.sh that
# fails stops here rather than configuring with an empty prefix.
build-2: deps-torch2
	@test -f $(BUILD2)/CMakeCache.txt || { \
	  prefix=$$(bash scripts/torch2.sh prefix) && \
	  cmake -S . -B $(BUILD2) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	        -DCMAKE_PREFIX_PATH="$$prefix" -DTDIST_WITH_NCCL=ON $(CMAKE_ARGS); }
	cmake --build $(BUILD2) -j $(JOBS)

# Both suites always run; one summary line each, then the total.
test:
	@MAKE="$(MAKE)" bash scripts/test-suites.sh test-1.13 test-2

test-1.13: build deps-pyref
	cd $(BUILD) && $(CTEST)

test-2: build-2 deps-pyref
	cd $(BUILD2) && $(CTEST)

# On a machine with an NVIDIA GPU: the CUDA tests (cuda_test, label gpu),
# which CI (no GPU) builds but does not run; docs/cuda.md.
test-gpu: build-2
	cmake -B $(BUILD2) -DTDIST_GPU_TESTS=ON
	cmake --build $(BUILD2) -j $(JOBS) --target cuda_test nccl_test
	cd $(BUILD2) && ctest --output-on-failure --timeout 600 -R "Cuda|Nccl"

# Fashion-MNIST on 2 ranks with DistributedDataParallel (about a minute
# here); ARGS: more of fashion_mnist's flags (--quiet, --all-ranks, ...).
ARGS ?=
demo: build
	$(BUILD)/bin/tdist-run --nproc-per-node 2 $(BUILD)/bin/fashion_mnist --epochs 4 --json $(BUILD)/demo.json $(ARGS)

# GPT-2 (Hugging Face's layout) on Debian's fortunes, 2 ranks, FSDP
# FULL_SHARD with a unit per block (a few minutes here; docs/gpt.md).
demo-gpt: build
	$(BUILD)/bin/tdist-run --nproc-per-node 2 $(BUILD)/bin/gpt --steps 300 --eval-interval 100 \
	  --save-pretrained $(BUILD)/gpt-demo --json $(BUILD)/demo-gpt.json

# tdist on both LibTorch versions against the references: PyTorch 1.13
# (Debian's python3-torch) and PyTorch 2.x (the wheel in .venv, with the
# CUDA libraries `import torch` needs), OpenMPI; then the charts
# (collectives.png, ddp.png, fsdp.png in $(BUILD)/bench; docs/benchmarks.md).
bench: build build-2
	@bash scripts/install-deps.sh --bench
	@bash scripts/torch2.sh python
	@bash scripts/python-ref.sh bench
	mkdir -p $(BUILD)/bench
	$(BUILD)/bin/tdist-bench store --json $(BUILD)/bench/store.json
	bash bench/compare_collectives.sh $(BUILD) $(BUILD)/bench
	bash bench/compare_ddp.sh $(BUILD) $(BUILD)/bench $(BUILD2)
	bash bench/compare_fsdp.sh $(BUILD) $(BUILD)/bench/fsdp-compare $(BUILD2)
	.venv/bin/python bench/plot.py $(BUILD)/bench

# Training across two network namespaces over a rate-limited link (root).
slow-link: build
	mkdir -p $(BUILD)/bench
	bash bench/slow_link.sh $(BUILD)/bin $(BUILD)/bench

# A local etcd for tdist-run --rdzv-backend etcd: ETCD_ARGS="--members 3"
# for three members on loopback; make etcd-stop stops them.
etcd: deps
	@bash scripts/etcd.sh start $(ETCD_ARGS)
etcd-stop:
	@bash scripts/etcd.sh stop $(ETCD_ARGS)

# The suite under sanitizers (against LibTorch 1.13), each in its own tree.
asan: deps
	$(MAKE) test-1.13 BUILD=build-asan CMAKE_ARGS="-DTDIST_SANITIZE=address,undefined"
tsan: deps
	TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp second_deadlock_stack=1" \
	  $(MAKE) test-1.13 BUILD=build-tsan CMAKE_ARGS="-DTDIST_SANITIZE=thread"

fuzz: deps
	scripts/fuzz.sh 300 $(BUILD)/fuzz

clean:
	rm -rf build build-torch2 build-asan build-tsan
