#!/usr/bin/env bash
# run.sh - runs the libFuzzer harnesses built in build/fuzz/ (make fuzz builds them first).
#
# Usage: tests/fuzz/run.sh SECONDS HARNESS...   (e.g. tests/fuzz/run.sh 60 layout prefetch)
# For each harness: replays its kept crash inputs (tests/fuzz/regressions/<harness>/*, each a
# crash once, fixed since), then fuzzes for SECONDS from the corpus in build/fuzz/corpus/
# <harness>/, which grows from run to run. Writes build/fuzz/<harness>.log and any crash input
# as build/fuzz/crash-<harness>-<sha1>; prints one line per harness (executions, coverage,
# corpus size); exits 1 when a harness crashed. A fixed crash input belongs in
# tests/fuzz/regressions/<harness>/, where this replays it and ctest-style checks keep it.
set -u
seconds=$1
shift
cd "$(dirname "$0")/../.."
status=0
for h in "$@"; do
  bin=build/fuzz/fuzz_$h
  log=build/fuzz/$h.log
  mkdir -p "build/fuzz/corpus/$h"
  kept=(tests/fuzz/regressions/"$h"/*)
  if [ -e "${kept[0]}" ]; then
    if ! "$bin" "${kept[@]}" > "build/fuzz/$h.replay.log" 2>&1; then
      echo "fuzz_$h: a kept regression input crashes again (build/fuzz/$h.replay.log)"
      status=1
      continue
    fi
    echo "fuzz_$h: ${#kept[@]} regression inputs replayed, no crash"
  fi
  "$bin" -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="build/fuzz/crash-$h-" \
    "build/fuzz/corpus/$h" > "$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
  corpus=$(ls "build/fuzz/corpus/$h" | wc -l)
  if [ "$rc" -ne 0 ]; then
    echo "fuzz_$h: CRASH after ${execs:-?} executions (exit $rc); input and report in $log:"
    grep -E '^(==[0-9]+==ERROR|SUMMARY|.*Test unit written to)' "$log" | head -n 5
    status=1
  else
    echo "fuzz_$h: ${seconds} s, ${execs} executions, ${cov:-cov: ?} edges, corpus ${corpus}, no crash"
  fi
done
exit $status
