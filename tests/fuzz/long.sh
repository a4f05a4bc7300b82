#!/usr/bin/env bash
# tests/fuzz/long.sh NAME RUNS [WORKERS] [BUILD]: a long run of the libFuzzer
# harness BUILD/fuzz_NAME (make fuzz) with WORKERS processes (default: every
# core) until RUNS executions in all, from its seeds and the corpus of earlier
# runs (BUILD/fuzz-corpus/NAME, which grows). libFuzzer's -fork mode: the
# parent counts the executions of every worker and stops past RUNS (a little
# past: the jobs under way finish), or at the first crash, leak or timeout,
# whose input it keeps in BUILD/fuzz-out/NAME/. Prints the total, the count
# that issue 26 asks of each fuzzer (10 million):
#
#   make fuzz && tests/fuzz/long.sh jinja 10000000 16
#   make fuzz-long FUZZ_RUNS=10000000 FUZZ_WORKERS=16     (tokenizer, then jinja)
#
# The log is BUILD/fuzz-out/NAME/long.log; its "#N:" lines are the running total.
set -u
name=$1 runs=$2 workers=${3:-$(nproc)} build=${4:-build}
case $name in
  gguf) seeds=tests/fixtures/gguf ;;
  *) seeds=tests/fuzz/corpus/$name ;;
esac
corpus=$build/fuzz-corpus/$name out=$build/fuzz-out/$name
mkdir -p "$corpus" "$out"
echo "  FUZZ  $name: $runs executions, $workers workers (log: $out/long.log)"
start=$(date +%s)
"$build/fuzz_$name" -fork="$workers" -runs="$runs" -timeout=20 -rss_limit_mb=4096 \
  -artifact_prefix="$out/" "$corpus" "$seeds" > "$out/long.log" 2>&1
rc=$?
total=$(grep -o '^#[0-9]*:' "$out/long.log" | tr -dc '0-9\n' | tail -n 1)
echo "        $name: ${total:-0} executions in $(($(date +%s) - start)) s, $workers workers," \
  "corpus $(ls "$corpus" | wc -l) inputs, exit $rc"
if [ $rc -ne 0 ]; then
  echo "        $name: FAILED; the log's end ($out/long.log):"
  tail -n 40 "$out/long.log" | sed 's/^/        /'
fi
exit $rc
