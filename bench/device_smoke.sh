#!/usr/bin/env bash
# Device smoke run: the speculative benchmark (--quick) and a distillation-throughput run on
# whatever accelerator JAX finds (TPU, GPU, else CPU), each writing its JSON, plus a
# device.json that says which devices they ran on.
#
#   bash bench/device_smoke.sh [OUT_DIR] [--smoke]   (default: bench_device_smoke/)
#
# --smoke passes --smoke to both scripts (tiny shapes, seconds: checks that they run; the
# suite runs it, tests/test_bench_smoke.py).
#
# Install first: pip install -e '.[tpu]' (TPU VM) or pip install -e '.[cuda]' (NVIDIA GPU).
# Timing is not pinned to cores on an accelerator (--cpus 0): the host only feeds the device.
set -euo pipefail

if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/.."
OUT_DIR="${1:-bench_device_smoke}"
SMOKE=()
if [[ "${2:-}" == "--smoke" ]]; then
  SMOKE=(--smoke)
fi
PYTHON="${PYTHON:-python}"
mkdir -p "${OUT_DIR}"

"${PYTHON}" - "${OUT_DIR}/device.json" <<'PY'
import json, sys
import jax
info = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
        "process_count": jax.process_count()}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print("devices:", info)
if info["backend"] == "cpu":
  print("WARNING: no accelerator found; the numbers below are CPU numbers.", file=sys.stderr)
PY

CPUS=0
# The backend device.json names (reading it starts no second JAX backend).
if "${PYTHON}" -c "import json, sys; sys.exit(json.load(open(sys.argv[1]))['backend'] != 'cpu')" \
    "${OUT_DIR}/device.json"; then
  CPUS=1  # CPU only: the benchmark's own default, one pinned core
fi

echo "=== speculative benchmark (--quick) ==="
"${PYTHON}" bench/speculative.py --quick --cpus "${CPUS}" --out "${OUT_DIR}/speculative.json" \
  ${SMOKE[@]+"${SMOKE[@]}"}

echo "=== distillation throughput ==="
"${PYTHON}" bench/distill_throughput.py --out "${OUT_DIR}/distill_throughput.json" ${SMOKE[@]+"${SMOKE[@]}"}

echo "wrote ${OUT_DIR}/device.json, speculative.json, distill_throughput.json"
