#!/usr/bin/env bash
# Multi-node GPU example: one process per node, wired by the coordinator flags of the binaries
# (--coordinator_address=<first node>:PORT --process_count=N --process_index=I, see
# distillspec_jax/multihost.py). Each process uses all the GPUs of its node.
#
# Not run in CI. Prerequisites: passwordless ssh to every node, the repository at REMOTE_DIR on
# every node with `pip install -e '.[cuda]'` done (jax[cuda12]==0.10.2), a MODEL_DIR on a
# file system all nodes share (NFS, or gs:// / s3-style paths that orbax and TF can write),
# and PORT open between the nodes.
#
# Usage: NODES="gpu-node-0 gpu-node-1" bash launch/gpu_multinode.sh [--dry_run]
#   --dry_run prints each node's command and runs nothing.
set -euo pipefail

DRY_RUN=0
for arg in "$@"; do
  case "${arg}" in
    --dry_run) DRY_RUN=1 ;;
    *) echo "Unknown argument ${arg}; the only flag is --dry_run (variables come from the environment)." >&2; exit 2 ;;
  esac
done

NODES="${NODES:-gpu-node-0 gpu-node-1}"            # the first one serves the coordinator
PORT="${PORT:-1234}"
GIN_FILE="${GIN_FILE:-gin/runs/paper_xsum.gin}"
BINARY="${BINARY:-distillspec_jax.main}"            # or distillspec_jax.train
MODEL_DIR="${MODEL_DIR:-/shared/distillspec/run1}"
EXTRA_GIN_BINDINGS="${EXTRA_GIN_BINDINGS:-}"
REMOTE_DIR="${REMOTE_DIR:-\$HOME/distillspec-jax}"   # expanded on the nodes

read -r -a NODE_LIST <<< "${NODES}"
COUNT="${#NODE_LIST[@]}"
COORDINATOR="${NODE_LIST[0]}:${PORT}"
echo "# ${COUNT} nodes, coordinator ${COORDINATOR}"
PIDS=()
for (( index = 0; index < COUNT; index++ )); do
  node="${NODE_LIST[${index}]}"
  CMD="cd ${REMOTE_DIR} && .venv/bin/python -m ${BINARY} --coordinator_address=${COORDINATOR} \
--process_count=${COUNT} --process_index=${index} --gin_file=${GIN_FILE} \
--gin.MODEL_DIR=\"'${MODEL_DIR}'\" ${EXTRA_GIN_BINDINGS} 2>&1 | tee -a \$HOME/distillspec_${index}.log"
  printf 'ssh %q %q\n' "${node}" "${CMD}"
  if [ "${DRY_RUN}" = 0 ]; then
    ssh "${node}" "${CMD}" &
    PIDS+=($!)
  fi
done
if [ "${DRY_RUN}" = 0 ]; then
  status=0
  for pid in "${PIDS[@]}"; do wait "${pid}" || status=$?; done
  exit "${status}"
fi
