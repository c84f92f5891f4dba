#!/usr/bin/env bash
# Runs every experiment script, one after another, and times each.
#
# Usage, from the repository root:
#   bash experiments/run_all.sh              # every script at its full settings (hours; writes
#                                            # experiments/results/)
#   bash experiments/run_all.sh --smoke      # every script's cheapest variant (writes under
#                                            # $TMPDIR/tpipe_experiments_smoke/, never results/)
#   bash experiments/run_all.sh [--smoke] remat scaling   # only these scripts
#
# The scripts that compile for a TPU slice need the TPU compiler (libtpu: the tpu or test extra);
# where it cannot compile they are skipped with the reason. engine_comparison compares this tree
# with an older one: set TPIPE_BASELINE to a checkout of it (git worktree add /tmp/old_tpipe
# COMMIT); without it, it compares this tree with itself. gpu_action_costs times on a GPU (on a
# CPU-only machine only its smoke variant means anything). Exit status 1 if any script failed.
set -uo pipefail
cd "$(dirname "$0")/.."

# Every script under experiments/ (tests/test_experiments.py checks the list is complete), in
# index order: the GPipe tables, the pipeline itself, schedules, memory, scale, multislice.
SCRIPTS=(
  table1_max_depth table2_schedule_efficiency remat scaling core_benchmark
  engine_comparison compile_times fused_schedules compound_memory compound_profiles
  search_robustness gpu_action_costs weight_placement remat_granularity_grad sequential_memory tpu_memory
  tpu_gradient_sums
  scale_3d memory_at_scale checkpoint_memory multislice multislice_moments streamed_inputs
  digits_baseline moe_memory moe_dispatch moe_exchange_parts moe_overlap moe_exposed step_time
  step_time_8b
  flash_attention
)
# The ones that compile for a TPU topology with libtpu.
TPU=" tpu_memory tpu_gradient_sums scale_3d memory_at_scale checkpoint_memory streamed_inputs "
TPU+="multislice_moments moe_memory moe_dispatch moe_exchange_parts moe_overlap moe_exposed "
TPU+="step_time "
TPU+="step_time_8b flash_attention "

flags=()
names=()
for arg in "$@"; do
  case "$arg" in
    --smoke) flags+=(--smoke) ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) names+=("$arg") ;;
  esac
done
[ ${#names[@]} -eq 0 ] && names=("${SCRIPTS[@]}")

tpu_reason=$(python - <<'PY' 2>&1 | tail -1
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
try:
  import tpipe
  tpipe.topology_devices("v5p:2x2x2")
  print("ok")
except Exception as error:  # pylint: disable=broad-except
  print(f"no TPU compiler here: {error}")
PY
)

start=$(date +%s)
failed=()
for exp in "${names[@]}"; do
  if [ ! -f "experiments/${exp}.py" ]; then
    echo "experiments.${exp}: no such script" >&2; failed+=("$exp"); continue
  fi
  if [[ "$TPU" == *" ${exp} "* && "$tpu_reason" != "ok" ]]; then
    echo "experiments.${exp}: skipped (${tpu_reason})"; continue
  fi
  extra=()
  if [ "$exp" = engine_comparison ]; then
    extra=(--baseline "${TPIPE_BASELINE:-$PWD}")
    [ -z "${TPIPE_BASELINE:-}" ] && echo "engine_comparison: TPIPE_BASELINE unset, comparing this tree with itself"
  fi
  t0=$(date +%s)
  if python -m "experiments.${exp}" "${flags[@]}" "${extra[@]}"; then
    echo "experiments.${exp}: $(( $(date +%s) - t0 )) s"
  else
    echo "experiments.${exp}: FAILED after $(( $(date +%s) - t0 )) s" >&2; failed+=("$exp")
  fi
done
echo "all ${#names[@]}: $(( $(date +%s) - start )) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2; exit 1
fi
