#!/usr/bin/env bash
# The main suite beside a busy machine: one CPU-bound process per core runs for the whole time,
# as a compile or a training job would beside a contributor's test run. The suite runs RUNS
# times in a row (default 3), each in full; the script exits 1 if any run fails.
#
#   bash benchmarks/busy_suite.sh                 # 3 serial runs of `python3 -m pytest`
#   RUNS=1 bash benchmarks/busy_suite.sh -n 2     # one run, pytest's own arguments after
#
# Each run's last pytest line, its wall time and the load average go to standard output and to
# benchmarks/out/busy_suite.md (the rows of benchmarks/RESULTS.md); a failed run's whole output to
# benchmarks/out/busy_suite-runN.log.
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${RUNS:-3}"
python="${PYTHON:-python3}"
out=benchmarks/out/busy_suite.md
mkdir -p "$(dirname "$out")"

hogs=()
stop_hogs() { (( ${#hogs[@]} )) && kill "${hogs[@]}" 2>/dev/null; wait 2>/dev/null; }
trap stop_hogs EXIT
for _ in $(seq "$(nproc)"); do
    "$python" -c "while True: pass" &
    hogs+=($!)
done

{
    echo "| run | result | wall s | load average at the end |"
    echo "|---|---|---|---|"
} | tee "$out"
failed=0
for run in $(seq "$runs"); do
    log=$(mktemp)
    start=$SECONDS
    "$python" -m pytest "$@" >"$log" 2>&1
    code=$?
    summary=$(grep -E "(passed|failed|error)" "$log" | tail -n 1 | tr -d '=' | xargs)
    echo "| $run | ${summary:-exit $code} | $(( SECONDS - start )) | $(cut -d' ' -f1-3 /proc/loadavg) |" | tee -a "$out"
    if (( code != 0 )); then
        failed=1
        grep -E "^(FAILED|ERROR) " "$log" | tee -a "$out"
        cp "$log" "benchmarks/out/busy_suite-run$run.log"  # the failure's whole report
    fi
    rm -f "$log"
done
exit "$failed"
