#!/usr/bin/env bash
# Runs the four measurement experiments (GPipe Tables 1 and 2 in kind, remat, scaling) and
# times them. Every number is from ahead-of-time compiles on 8 emulated CPU devices; nothing
# trains. Usage, from the repository root:  bash experiments/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
for exp in table1_max_depth table2_schedule_efficiency remat scaling; do
  t0=$(date +%s)
  python -m "experiments.${exp}"
  echo "experiments.${exp}: $(( $(date +%s) - t0 )) s"
done
echo "all four: $(( $(date +%s) - start )) s"
