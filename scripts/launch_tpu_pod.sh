#!/usr/bin/env bash
# Runs one command on every worker (host) of a Cloud TPU VM pod slice, as one multi-process job.
#
#   scripts/launch_tpu_pod.sh --tpu=NAME --zone=ZONE [--project=P] [--setup] -- \
#       python scripts/rl.py --config=configs/v5e_8.py --workdir=gs://bucket/run1
#
# Every worker runs the command in ~/meshrl with MESHRL_TPU_POD=1, so scripts/rl.py (and sft.py)
# join the job through jax.distributed.initialize(), which reads the coordinator and the process
# ids from the TPU metadata; the mesh in the config spans all chips of all workers. --setup first
# copies this checkout's committed HEAD to every worker and installs it with the tpu extra. The
# workdir must be storage every worker reaches (a GCS bucket or a shared filesystem): orbax writes
# checkpoints from all workers, metrics and evaluations come from worker 0 only.
# Needs the gcloud CLI, authenticated, with access to the TPU.
set -euo pipefail

tpu="" zone="" project="" setup=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu=*) tpu="${1#*=}" ;;
    --zone=*) zone="${1#*=}" ;;
    --project=*) project="${1#*=}" ;;
    --setup) setup=1 ;;
    --) shift; break ;;
    *) echo "error: unknown argument $1 (usage: --tpu=NAME --zone=ZONE [--project=P] [--setup] -- COMMAND)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z "$tpu" || -z "$zone" ]]; then
  echo "error: --tpu=NAME and --zone=ZONE are required" >&2; exit 2
fi
if [[ $# -eq 0 && $setup -eq 0 ]]; then
  echo "error: no command after -- (and no --setup)" >&2; exit 2
fi
if ! command -v gcloud >/dev/null; then
  echo "error: the gcloud CLI is not installed (https://cloud.google.com/sdk/docs/install)" >&2; exit 2
fi

gc=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[[ -n "$project" ]] && where+=(--project="$project")

if [[ $setup -eq 1 ]]; then
  archive=$(mktemp --suffix=.tar.gz)
  git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$archive" HEAD
  "${gc[@]}" scp "$archive" "$tpu":/tmp/meshrl.tar.gz "${where[@]}" --worker=all
  "${gc[@]}" ssh "$tpu" "${where[@]}" --worker=all --command \
    'rm -rf ~/meshrl && mkdir -p ~/meshrl && tar -xzf /tmp/meshrl.tar.gz -C ~/meshrl && cd ~/meshrl && python3 -m venv .venv && . .venv/bin/activate && pip install -q -e ".[tpu]"'
  rm -f "$archive"
fi

if [[ $# -gt 0 ]]; then
  command=$(printf '%q ' "$@")
  "${gc[@]}" ssh "$tpu" "${where[@]}" --worker=all --command \
    "cd ~/meshrl && . .venv/bin/activate && MESHRL_TPU_POD=1 $command"
fi
