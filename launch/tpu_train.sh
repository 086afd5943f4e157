#!/usr/bin/env bash
# Launch a distillation run on a Cloud TPU VM slice, T5X style: the same command runs on every
# host of the slice (--worker=all); JAX discovers the slice topology itself, and every host
# reads its shard of the data and writes to the shared gs:// model directory.
#
# Not run in CI. Prerequisites: `gcloud auth login`, a TPU VM slice already created, e.g.
#   gcloud compute tpus tpu-vm create "${TPU_NAME}" --zone="${ZONE}" \
#     --accelerator-type=v4-32 --version=tpu-ubuntu2204-base
# and a GCS bucket the TPU service account can write to.
#
# Usage: edit the variables below (or export them), then `bash launch/tpu_train.sh`.
#        `bash launch/tpu_train.sh --dry_run` prints the commands (the gcloud calls and what each
#        host of the slice runs) and runs nothing.
set -euo pipefail

DRY_RUN=0
for arg in "$@"; do
  case "${arg}" in
    --dry_run) DRY_RUN=1 ;;
    *) echo "Unknown argument ${arg}; the only flag is --dry_run (variables come from the environment)." >&2; exit 2 ;;
  esac
done

# ---- what to run --------------------------------------------------------------------------
PROJECT="${PROJECT:-my-gcp-project}"
ZONE="${ZONE:-us-central2-b}"
TPU_NAME="${TPU_NAME:-distillspec-v4-32}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}"      # v4-N: N TensorCores, 8 per host
GIN_FILE="${GIN_FILE:-gin/runs/paper_xsum.gin}"    # a run file under gin/runs/
BINARY="${BINARY:-distillspec_jax.main}"            # main (gin/runs/paper_*.gin, demo.gin)
                                                    # or train (finetune_*/distill_*.gin)
MODEL_DIR="${MODEL_DIR:-gs://my-bucket/distillspec/$(date +%Y%m%d-%H%M%S)}"
TFDS_DATA_DIR="${TFDS_DATA_DIR:-gs://my-bucket/tensorflow_datasets}"
EXTRA_GIN_BINDINGS="${EXTRA_GIN_BINDINGS:-}"        # e.g. "--gin.TRAIN_STEPS=20000"

# ---- where the code comes from -------------------------------------------------------------
REPO_URL="${REPO_URL:-https://github.com/my-org/distillspec-jax.git}"
REPO_REF="${REPO_REF:-main}"
REMOTE_DIR="${REMOTE_DIR:-\$HOME/distillspec-jax}"   # expanded on the TPU hosts
JAX_EXTRA="${JAX_EXTRA:-.[tpu]}"                    # pyproject's extra: jax[tpu]==0.10.2

case "${ACCELERATOR_TYPE}" in
  v4-*) CORES="${ACCELERATOR_TYPE#v4-}"; NUM_HOSTS=$(( CORES < 8 ? 1 : CORES / 8 )) ;;
  *) echo "ACCELERATOR_TYPE=${ACCELERATOR_TYPE}: this script knows v4 slices (v4-8, v4-32, ...)." >&2; exit 2 ;;
esac

run() {  # prints the command; runs it unless --dry_run
  printf '%q ' "$@"; echo
  if [ "${DRY_RUN}" = 0 ]; then "$@"; fi
}

# ---- 1. install the same code on every host ------------------------------------------------
SETUP_CMD="set -e
if [ ! -d ${REMOTE_DIR} ]; then git clone ${REPO_URL} ${REMOTE_DIR}; fi
cd ${REMOTE_DIR} && git fetch -q origin && git checkout -q ${REPO_REF} && git pull -q --ff-only || true
python3 -m venv .venv
.venv/bin/pip install -q -e '${JAX_EXTRA}' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html"

echo "# ${ACCELERATOR_TYPE}: ${NUM_HOSTS} hosts; 1. install on every host (--worker=all)"
run gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --project="${PROJECT}" --zone="${ZONE}" \
  --worker=all --command "${SETUP_CMD}"

# ---- 2. train: one process per host, all started together ---------------------------------
# No coordinator flags: on a TPU VM the binaries call jax.distributed.initialize() with no
# arguments and JAX finds the slice's hosts itself (distillspec_jax/multihost.py).
TRAIN_CMD="cd ${REMOTE_DIR} && TFDS_DATA_DIR=${TFDS_DATA_DIR} .venv/bin/python -m ${BINARY} \
--gin_file=${GIN_FILE} --gin.MODEL_DIR=\"'${MODEL_DIR}'\" ${EXTRA_GIN_BINDINGS} \
2>&1 | tee -a \$HOME/distillspec_train.log"

echo "# 2. train: the same command on each of the ${NUM_HOSTS} hosts (--worker=all)"
run gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --project="${PROJECT}" --zone="${ZONE}" \
  --worker=all --command "${TRAIN_CMD}"
if [ "${DRY_RUN}" = 1 ]; then
  for (( worker = 0; worker < NUM_HOSTS; worker++ )); do
    echo "# host ${worker} of ${NUM_HOSTS} (jax.process_index() = ${worker}) runs: ${TRAIN_CMD}"
  done
fi

echo "Checkpoints and TensorBoard summaries: ${MODEL_DIR}"
echo "  tensorboard --logdir=${MODEL_DIR}"
