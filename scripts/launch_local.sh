#!/usr/bin/env bash
# Runs tpipe.train as N local processes with K emulated CPU devices each, joined by
# jax.distributed on 127.0.0.1: a multi-host run on one machine.
#
# Usage:
#   scripts/launch_local.sh [-n NUM_PROCESSES] [-k DEVICES_PER_PROCESS] [-p PORT] -- TRAIN_ARGS...
# Example (2 processes x 4 devices = the default data=2 x stage=4 mesh):
#   scripts/launch_local.sh -n 2 -k 4 -- --config=configs/lm.py:size=tiny --workdir=/tmp/mh
#
# Process 0 writes the metrics; process i's terminal output goes to LOG_DIR/launch_local.<i>.log
# (LOG_DIR defaults to the current directory). Exits non-zero if any process fails.
set -euo pipefail

num_processes=2
devices_per_process=4
port=""
while getopts "n:k:p:h" opt; do
  case "$opt" in
    n) num_processes="$OPTARG" ;;
    k) devices_per_process="$OPTARG" ;;
    p) port="$OPTARG" ;;
    h|*) sed -n '2,13p' "$0"; exit 1 ;;
  esac
done
shift $((OPTIND - 1))
[[ "${1:-}" == "--" ]] && shift

if [[ -z "$port" ]]; then
  # A free TCP port on localhost, chosen by the OS.
  port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
log_dir="${LOG_DIR:-.}"
mkdir -p "$log_dir"

pids=()
for ((i = 0; i < num_processes; i++)); do
  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES="$devices_per_process" \
    python -m tpipe.train "$@" \
      --coordinator_address="127.0.0.1:${port}" \
      --num_processes="$num_processes" --process_id="$i" \
      >"${log_dir}/launch_local.${i}.log" 2>&1 &
  pids+=($!)
done
echo "Started ${num_processes} processes (${pids[*]}) on 127.0.0.1:${port}; logs in ${log_dir}/launch_local.*.log"

status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "process $i (pid ${pids[$i]}) failed; see ${log_dir}/launch_local.${i}.log" >&2
    status=1
  fi
done
exit "$status"
