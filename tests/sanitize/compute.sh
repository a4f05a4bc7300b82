#!/usr/bin/env bash
# tests/sanitize/compute.sh [BUILD] [FILTER]: the test suites of an existing
# CUDA build under compute-sanitizer's four tools (make sanitize runs it on a
# GPU machine). For each tool it runs the Criterion tests and the Lua suite
# (FILTER: an extended regular expression; only the Lua test files whose name
# matches it, e.g. 'kernels|attention'), then prints the sanitizer's ERROR SUMMARY line, the runner's own
# summary line, the exit status (and the signal, when one ended the process)
# and where the whole log is. Exit status: non-zero when a tool reported an
# error or a suite failed.
#
# LuaJIT's machine code is not run under the sanitizer: the Lua suite runs
# with the JIT off (-e 'jit.off()'), one process a test file, SANITIZE_JOBS
# (default 8) at a time on the one GPU; each file's log is
# $BUILD/sanitize/TOOL-lua/FILE.log. racecheck and synccheck are slow on the
# big cases: SANITIZE_TOOLS='memcheck initcheck' picks tools, SANITIZE_ARGS
# adds compute-sanitizer flags (e.g. --target-processes application-only),
# SANITIZE_C=0 skips the Criterion suite. Under initcheck GPUSH_SANITIZER=
# initcheck makes the matrix products zero their outputs before cuBLAS writes
# them (initcheck does not see cuBLAS's TMA stores; kernels/matmul.cu), and
# cuBLASLt's own split-K reduction and epilogue kernels, which read what its
# GEMM kernels stored the same way, are left out (--kernel-name-exclude).
set -u
build=${1:-build}
filter=${2:-}
tools=${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}
cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
out=$build/sanitize
mkdir -p "$out"
if [ ! -x "$cs" ]; then echo "sanitize: compute-sanitizer not found (CUDA toolkit)"; exit 2; fi
if ! "$build/gpush" -e 'os.exit(gp.cuda_available() and 0 or 3)'; then
  echo "sanitize: no usable CUDA GPU (or $build/gpush is a CPU build): nothing to check"; exit 2
fi
status() { # the exit status in words: 'exit 0', 'exit 1', 'signal SEGV'
  local rc=$1
  if [ "$rc" -gt 128 ]; then echo "signal $(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))"; else echo "exit $rc"; fi
}
rc_all=0
for tool in $tools; do
  export GPUSH_SANITIZER=$tool # tests that time things skip those checks under an instrumented GPU
  extra=""
  [ "$tool" = memcheck ] && extra="--leak-check full"
  [ "$tool" = initcheck ] && extra="--kernel-name-exclude kns=cublasLt"
  report() { # NAME LOG RC: one line, and the log's end when it failed
    local summary runner
    summary=$(grep -a "ERROR SUMMARY\|RACECHECK SUMMARY\|LEAK SUMMARY" "$2" | tail -n 2 | tr '\n' ' ')
    runner=$(grep -a "Synthesis:\|passed, .* failed" "$2" | tail -n 1)
    printf '%-9s %-24s %-12s %s | %s\n' "$tool" "$1" "$(status "$3")" "${summary:-NO SANITIZER SUMMARY}" \
      "${runner:-NO RUNNER SUMMARY}"
    if [ "$3" -ne 0 ] || [ -z "$summary" ] || [ -z "$runner" ]; then
      rc_all=1
      echo "          log: $2 (its last lines:)"
      tail -n 15 "$2" | sed 's/^/          /'
    fi
  }
  if [ "${SANITIZE_C:-1}" != 0 ]; then
    log=$out/$tool-c.log
    "$cs" --tool "$tool" $extra --error-exitcode 99 ${SANITIZE_ARGS:-} "$build/test_c" --jobs 1 > "$log" 2>&1
    report c "$log" $?
  fi
  rm -rf "$out/$tool-lua"
  mkdir -p "$out/$tool-lua"
  # one process a test file (FILTER: the files whose name matches it), in parallel
  ls tests/lua/test_*.lua | sed 's|.*/||; s|\.lua$||' | grep -E -- "$filter" |
    SAN_CS=$cs SAN_TOOL=$tool SAN_EXTRA=$extra SAN_OUT=$out/$tool-lua SAN_BUILD=$build \
    xargs -P "${SANITIZE_JOBS:-8}" -I{} sh -c '"$SAN_CS" --tool "$SAN_TOOL" $SAN_EXTRA --error-exitcode 99 \
      ${SANITIZE_ARGS:-} "$SAN_BUILD/gpush" -e "jit.off()" tests/lua/run.lua "{}: " > "$SAN_OUT/{}.log" 2>&1;
      echo $? > "$SAN_OUT/{}.rc"'
  for rcf in "$out/$tool-lua"/*.rc; do
    f=${rcf%.rc}
    report "lua ${f##*/}" "$f.log" "$(cat "$rcf")"
  done
done
exit $rc_all
