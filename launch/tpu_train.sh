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
set -euo pipefail

# ---- what to run --------------------------------------------------------------------------
PROJECT="${PROJECT:-my-gcp-project}"
ZONE="${ZONE:-us-central2-b}"
TPU_NAME="${TPU_NAME:-distillspec-v4-32}"
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
JAX_EXTRA="${JAX_EXTRA:-jax[tpu]==0.10.2}"

# ---- 1. install the same code on every host ------------------------------------------------
SETUP_CMD="set -e
if [ ! -d ${REMOTE_DIR} ]; then git clone ${REPO_URL} ${REMOTE_DIR}; fi
cd ${REMOTE_DIR} && git fetch -q origin && git checkout -q ${REPO_REF} && git pull -q --ff-only || true
python3 -m venv .venv
.venv/bin/pip install -q -e .
.venv/bin/pip install -q '${JAX_EXTRA}' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html"

gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --project="${PROJECT}" --zone="${ZONE}" \
  --worker=all --command "${SETUP_CMD}"

# ---- 2. train: one process per host, all started together ---------------------------------
TRAIN_CMD="cd ${REMOTE_DIR} && TFDS_DATA_DIR=${TFDS_DATA_DIR} .venv/bin/python -m ${BINARY} \
  --gin_file=${GIN_FILE} \
  --gin.MODEL_DIR=\"'${MODEL_DIR}'\" \
  ${EXTRA_GIN_BINDINGS} \
  2>&1 | tee -a \$HOME/distillspec_train.log"

gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --project="${PROJECT}" --zone="${ZONE}" \
  --worker=all --command "${TRAIN_CMD}"

echo "Checkpoints and TensorBoard summaries: ${MODEL_DIR}"
echo "  tensorboard --logdir=${MODEL_DIR}"
