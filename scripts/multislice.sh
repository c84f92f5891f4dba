#!/usr/bin/env bash
# A multislice Cloud TPU job: create SLICES slices as one queued resource, install tpipe on every
# worker of every slice, and run the trainer on all of them at once.
#
# Usage:
#   scripts/multislice.sh create             # gcloud compute tpus queued-resources create ...
#   scripts/multislice.sh setup              # copy this checkout to every worker, pip install it
#   scripts/multislice.sh run TRAIN_ARGS...  # python -m tpipe.train TRAIN_ARGS everywhere
#   scripts/multislice.sh ssh COMMAND        # COMMAND on every worker of every slice
#   scripts/multislice.sh delete
#
# Settings (environment variables):
#   TPU_NAME=tpipe-ms (slices are TPU_NAME-0, TPU_NAME-1, ...)  SLICES=2  ZONE=us-east5-a
#   ACCELERATOR=v5p-128  RUNTIME=v2-alpha-tpuv5  PROJECT=<gcloud default>  REMOTE_DIR=tpipe
#
# The job's mesh says which axis crosses the slices (README, "Across TPU slices"):
#   --config.mesh.dcn.stage=2 puts the pipeline's halves on the two slices, so only
#   stage-boundary activations cross the data-centre network; the links between slices are
#   delayed by default (--config.transfer_delay=auto). Check the layout first on this machine:
#   python -m tpipe.train.cli.report --config=... --topology=v5p:4x4x4 --config.mesh.dcn.stage=2
# Every slice's hosts join one jax.distributed job by themselves (the TPU runtime sets it up);
# the workdir must be shared, e.g. gs://BUCKET/run.
set -euo pipefail

TPU_NAME="${TPU_NAME:-tpipe-ms}"
SLICES="${SLICES:-2}"
ZONE="${ZONE:-us-east5-a}"
ACCELERATOR="${ACCELERATOR:-v5p-128}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5}"
REMOTE_DIR="${REMOTE_DIR:-tpipe}"
project_flag=()
[[ -n "${PROJECT:-}" ]] && project_flag=(--project="$PROJECT")

repo_root="$(cd "$(dirname "$0")/.." && pwd)"

tpu() { gcloud compute tpus "$@" --zone="$ZONE" "${project_flag[@]}"; }
# COMMAND on every worker of every slice, the slices in parallel; fails if any fails.
on_every_slice() {
  local pids=() status=0
  for ((i = 0; i < SLICES; i++)); do
    tpu tpu-vm ssh "$TPU_NAME-$i" --worker=all --command="$1" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return "$status"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  create)
    tpu queued-resources create "$TPU_NAME" --accelerator-type="$ACCELERATOR" \
      --runtime-version="$RUNTIME" --node-count="$SLICES" --node-prefix="$TPU_NAME"
    ;;
  setup)
    archive="$(mktemp -t tpipe.XXXXXX.tar.gz)"
    git -C "$repo_root" archive --format=tar.gz -o "$archive" HEAD
    for ((i = 0; i < SLICES; i++)); do
      tpu tpu-vm scp "$archive" "$TPU_NAME-$i":tpipe.tar.gz --worker=all
    done
    rm -f "$archive"
    on_every_slice "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/tpipe.tar.gz -C ~/$REMOTE_DIR && \
      cd ~/$REMOTE_DIR && python3 -m pip install --quiet --upgrade pip && \
      python3 -m pip install --quiet -e '.[train,tpu]'"
    ;;
  run)
    [[ $# -gt 0 ]] || { echo "run needs trainer arguments, e.g. --config=configs/lm.py --workdir=gs://BUCKET/run" >&2; exit 1; }
    args="$(printf ' %q' "$@")"
    on_every_slice "cd ~/$REMOTE_DIR && python3 -m tpipe.train${args}"
    ;;
  ssh)
    [[ $# -gt 0 ]] || { echo "ssh needs a command to run on every worker" >&2; exit 1; }
    on_every_slice "$*"
    ;;
  delete)
    tpu queued-resources delete "$TPU_NAME" --force --quiet
    ;;
  *)
    sed -n '2,23p' "$0"
    exit 1
    ;;
esac
