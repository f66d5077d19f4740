# tdist: two commands do all the set-up on a fresh Debian 12 machine.
#   make demo   install what is missing, build, run the main job
#   make test   install what is missing, build, run the whole test suite
# Also: make build | make bench | make asan | make tsan | make fuzz | make clean

BUILD      ?= build
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
GENERATOR  := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")

.PHONY: all deps configure build test demo bench slow-link asan tsan fuzz clean

all: build

deps:
	@bash scripts/install-deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest -j $(JOBS) --output-on-failure --timeout 300

# Fashion-MNIST on 2 ranks with DistributedDataParallel (about a minute here).
demo: build
	$(BUILD)/bin/tdist-run --nproc-per-node 2 $(BUILD)/bin/fashion_mnist --epochs 4 --json $(BUILD)/demo.json

bench: build
	@bash scripts/install-deps.sh --bench
	mkdir -p $(BUILD)/bench
	$(BUILD)/bin/tdist-bench store --json $(BUILD)/bench/store.json
	bash bench/compare_collectives.sh $(BUILD) $(BUILD)/bench
	bash bench/compare_ddp.sh $(BUILD) $(BUILD)/bench

# Training across two network namespaces over a rate-limited link (root).
slow-link: build
	mkdir -p $(BUILD)/bench
	bash bench/slow_link.sh $(BUILD)/bin $(BUILD)/bench

# The suite under sanitizers, each in its own build tree.
asan: deps
	$(MAKE) test BUILD=build-asan CMAKE_ARGS="-DTDIST_SANITIZE=address,undefined"
tsan: deps
	TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp second_deadlock_stack=1" \
	  $(MAKE) test BUILD=build-tsan CMAKE_ARGS="-DTDIST_SANITIZE=thread"

fuzz: deps
	scripts/fuzz.sh 300 $(BUILD)/fuzz

clean:
	rm -rf build build-asan build-tsan
