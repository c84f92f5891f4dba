#!/usr/bin/env bash
# Create a Cloud TPU VM, install tpipe on every worker, and run the trainer on all workers.
#
# Usage:
#   scripts/tpu_vm.sh create             # gcloud compute tpus tpu-vm create ...
#   scripts/tpu_vm.sh setup              # copy this checkout's HEAD to every worker, pip install it
#                                        # (refuses uncommitted changes; SHIP=worktree ships
#                                        # the working tree as it is, uncommitted edits included)
#   scripts/tpu_vm.sh run TRAIN_ARGS...  # python -m tpipe.train TRAIN_ARGS on every worker
#   scripts/tpu_vm.sh ssh [COMMAND]      # a shell (worker 0) or COMMAND on every worker
#   scripts/tpu_vm.sh delete
#
# Settings (environment variables):
#   TPU_NAME=tpipe  ZONE=us-central2-b  ACCELERATOR=v4-8  RUNTIME=tpu-ubuntu2204-base
#   PROJECT=<gcloud default>  REMOTE_DIR=tpipe  SHIP=head (or worktree)
#
# Example (a v4-8 slice: 4 chips on one host; for a pod slice such as v4-32 the same `run`
# starts one process per host, and jax.distributed.initialize() joins them automatically):
#   ACCELERATOR=v4-8 scripts/tpu_vm.sh create
#   scripts/tpu_vm.sh setup
#   scripts/tpu_vm.sh run --config=configs/transformer_gpipe.py --workdir=/tmp/gpipe
#   scripts/tpu_vm.sh delete
# A multi-host pod slice needs a workdir that every host shares, e.g. a bucket:
#   scripts/tpu_vm.sh run --config=configs/transformer_gpipe.py --workdir=gs://BUCKET/gpipe
set -euo pipefail

TPU_NAME="${TPU_NAME:-tpipe}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR="${ACCELERATOR:-v4-8}"
RUNTIME="${RUNTIME:-tpu-ubuntu2204-base}"
REMOTE_DIR="${REMOTE_DIR:-tpipe}"
project_flag=()
[[ -n "${PROJECT:-}" ]] && project_flag=(--project="$PROJECT")

repo_root="$(cd "$(dirname "$0")/.." && pwd)"

tpu() { gcloud compute tpus tpu-vm "$@" --zone="$ZONE" "${project_flag[@]}"; }
on_all_workers() { tpu ssh "$TPU_NAME" --worker=all --command="$1"; }

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  create)
    tpu create "$TPU_NAME" --accelerator-type="$ACCELERATOR" --version="$RUNTIME"
    ;;
  setup)
    archive="$(mktemp -t tpipe.XXXXXX.tar.gz)"
    if [[ "${SHIP:-head}" == "worktree" ]]; then
      echo "Shipping the working tree (uncommitted changes included) of $repo_root."
      # Tracked and untracked files, .gitignore'd ones left out (deleted ones skipped).
      (cd "$repo_root" && git ls-files -z --cached --others --exclude-standard \
        | tar -czf "$archive" --null --ignore-failed-read -T - 2>/dev/null)
    else
      changes="$(git -C "$repo_root" status --porcelain --untracked-files=normal)"
      if [[ -n "$changes" ]]; then
        rm -f "$archive"
        echo "error: $repo_root has uncommitted changes ($(echo "$changes" | wc -l) files);" \
          "setup ships HEAD, which leaves them behind. Commit them, or ship the working tree" \
          "as it is with: SHIP=worktree scripts/tpu_vm.sh setup" >&2
        exit 1
      fi
      echo "Shipping commit $(git -C "$repo_root" rev-parse --short HEAD) of $repo_root."
      git -C "$repo_root" archive --format=tar.gz -o "$archive" HEAD
    fi
    tpu scp "$archive" "$TPU_NAME":tpipe.tar.gz --worker=all
    rm -f "$archive"
    on_all_workers "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/tpipe.tar.gz -C ~/$REMOTE_DIR && \
      cd ~/$REMOTE_DIR && python3 -m pip install --quiet --upgrade pip && \
      python3 -m pip install --quiet -e '.[train,tpu]' && \
      python3 -c 'import jax; print(jax.process_index(), jax.device_count(), jax.devices()[0].platform)'"
    ;;
  run)
    [[ $# -gt 0 ]] || { echo "run needs trainer arguments, e.g. --config=configs/lm.py --workdir=DIR" >&2; exit 1; }
    args="$(printf ' %q' "$@")"
    on_all_workers "cd ~/$REMOTE_DIR && python3 -m tpipe.train${args}"
    ;;
  ssh)
    if [[ $# -gt 0 ]]; then on_all_workers "$*"; else tpu ssh "$TPU_NAME" --worker=0; fi
    ;;
  delete)
    tpu delete "$TPU_NAME" --quiet
    ;;
  *)
    sed -n '2,24p' "$0"
    exit 1
    ;;
esac
