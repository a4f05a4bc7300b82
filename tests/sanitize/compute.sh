#!/usr/bin/env bash
# tests/sanitize/compute.sh [BUILD] [FILTER]: the test suites of an existing
# CUDA build under compute-sanitizer's four tools (make sanitize runs it on a
# GPU machine). For each tool it runs the Criterion tests and the Lua suite
# (FILTER: only the Lua cases whose name contains it; the CUDA ones are what
# matter), then prints the sanitizer's ERROR SUMMARY line, the runner's own
# summary line, the exit status (and the signal, when one ended the process)
# and where the whole log is. Exit status: non-zero when a tool reported an
# error or a suite failed.
#
# LuaJIT's machine code is not run under the sanitizer: the Lua suite runs
# with the JIT off (-e 'jit.off()'). racecheck and synccheck are slow on the
# big cases: SANITIZE_TOOLS='memcheck initcheck' picks tools, SANITIZE_ARGS
# adds compute-sanitizer flags (e.g. --target-processes application-only).
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
  extra=""
  [ "$tool" = memcheck ] && extra="--leak-check full"
  [ "$tool" = initcheck ] && extra="--track-unused-memory no"
  for suite in c lua; do
    log=$out/$tool-$suite.log
    if [ $suite = c ]; then
      "$cs" --tool "$tool" $extra --error-exitcode 99 ${SANITIZE_ARGS:-} "$build/test_c" --jobs 1 > "$log" 2>&1
    else
      "$cs" --tool "$tool" $extra --error-exitcode 99 ${SANITIZE_ARGS:-} \
        "$build/gpush" -e 'jit.off()' tests/lua/run.lua $filter > "$log" 2>&1
    fi
    rc=$?
    summary=$(grep -a "ERROR SUMMARY\|RACECHECK SUMMARY\|LEAK SUMMARY" "$log" | tail -n 2 | tr '\n' ' ')
    runner=$(grep -a "Synthesis:\|passed, .* failed" "$log" | tail -n 1)
    printf '%-9s %-3s %-12s %s | %s\n' "$tool" "$suite" "$(status $rc)" "${summary:-NO SANITIZER SUMMARY}" \
      "${runner:-NO RUNNER SUMMARY}"
    if [ $rc -ne 0 ]; then
      rc_all=1
      echo "          log: $log (its last lines:)"
      tail -n 15 "$log" | sed 's/^/          /'
    fi
  done
done
exit $rc_all
