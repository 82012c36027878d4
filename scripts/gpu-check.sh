#!/usr/bin/env bash
# GPU check for issue 12 (one command, no network, under 5 minutes on one NVIDIA GPU).
# Assumes: an NVIDIA driver, PyTorch built for CUDA 13, cuda-bindings, transformers; the
# kvd venv (.venv, or $PY) with kvd installed (pip install -e '.[cuda13,ref,dev]', or the
# wheels that travel with the repository: scripts/wheels/*.whl are installed offline first).
#   1. what this machine has (GPU, driver, torch CUDA, cuda-bindings, Mooncake build)
#   2. kvd doctor's transfer checks
#   3. cuda_ipc import + the local backend's device-to-device copy, byte-exact in another
#      process, with GB/s against a plain torch copy of the same pages (tests/gpu)
#   4. the unit tests of the memory plane (CUDA paths no longer skipped)
#   5. token-exact PD through two kvd daemons with the local backend, GPU KV pools:
#      runs once the room protocol carries ExportedPool (RegisterRank.pool); until then
#      it says SKIPPED and why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

if compgen -G "scripts/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --find-links scripts/wheels scripts/wheels/*.whl
fi

echo "== 1. machine"
nvidia-smi -L || { echo "no NVIDIA GPU/driver: nothing to check here"; exit 1; }
"$PY" - <<'PYEOF'
import torch
from kvd.memory import cuda
from kvd.transfer.backends.mooncake import build_info
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("kvd (cuda-bindings) sees", cuda.device_count(), "CUDA device(s);", "torch UUIDs:",
      [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())])
print("mooncake build", build_info() or "none")
PYEOF

echo "== 2. kvd doctor (transfer checks)"
"$PY" - <<'PYEOF'
from kvd.cli import doctor
from kvd.config import Settings
s = Settings(role="decode", transfer_backend="auto")
for c in [doctor.check_build(), doctor.check_transfer_settings(s)]:
    print(f"{c.status:5} {c.name}: {c.detail}")
PYEOF

echo "== 3. cuda_ipc + local backend copies (tests/gpu)"
timeout 180 "$PY" -m pytest tests/gpu -q -s -p no:cacheprovider

echo "== 4. memory-plane unit tests"
timeout 120 "$PY" -m pytest tests/unit/memory tests/unit/transfer/test_local_backend.py -q \
  -p no:cacheprovider

echo "== 5. PD through two kvd daemons, backend local, KV in GPU memory"
if "$PY" -c "import kvd.refengine.demo as d, sys; sys.exit(0 if hasattr(d, 'GPU_READY') else 1)"; then
  timeout 240 "$PY" -m kvd.cli.main demo --device cuda --transfer-backend local
else
  echo "SKIPPED: the room protocol does not carry ExportedPool yet (RegisterRank.pool is"
  echo "         defined, the daemons do not send/attach it) and the reference engines keep"
  echo "         their KV in host memory; see docs/transfer.md and the memory-plane report."
fi
echo "gpu-check finished in $(( $(date +%s) - started )) s"
