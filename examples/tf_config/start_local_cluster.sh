#!/usr/bin/env bash
# Start the three tasks of examples/tf_config on this machine, as three separate ds-train commands, and wait.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"
mkdir -p runs
ds_train="${DS_TRAIN:-ds-train}"
pids=()
for task in ps worker chief; do
  TF_CONFIG="$(cat "$here/$task.json")" OMP_NUM_THREADS=1 \
    $ds_train fit --config "$here/cluster.yaml" > "runs/tf_config_$task.log" 2>&1 &
  pids+=($!)
  echo "started $task (pid $!), log: runs/tf_config_$task.log"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
grep "\[ds_lightning\]" runs/tf_config_chief.log || true
exit "$status"
