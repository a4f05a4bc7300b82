#!/usr/bin/env bash
# tests/fuzz/run.sh BUILD NAME SECONDS SEED_DIR...: run the libFuzzer harness
# BUILD/fuzz_NAME for SECONDS from its seeds and the corpus of earlier runs
# (BUILD/fuzz-corpus/NAME, which grows); print its execution count; a crash
# (or a leak, a timeout) fails, with the input in BUILD/fuzz-out/NAME/.
set -u
build=$1 name=$2 secs=$3
shift 3
corpus=$build/fuzz-corpus/$name out=$build/fuzz-out/$name
mkdir -p "$corpus" "$out"
echo "  FUZZ  $name ($secs s)"
"$build/fuzz_$name" -max_total_time="$secs" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$out/" "$corpus" "$@" > "$out/log" 2>&1
rc=$?
execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$out/log" | grep -o '[0-9]*$')
echo "        $name: ${execs:-?} executions, corpus $(ls "$corpus" | wc -l) inputs"
if [ $rc -ne 0 ]; then
  echo "        $name: FAILED (exit $rc); the log's end ($out/log):"
  tail -n 40 "$out/log" | sed 's/^/        /'
fi
exit $rc
