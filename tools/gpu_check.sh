#!/usr/bin/env bash
# The checks only a GPU can answer (tools/gpu_check.py), on a machine with one NVIDIA GPU
# and no network: its python3 must hold torch with CUDA, transformers, tokenizers,
# safetensors, numpy, pyyaml and aiohttp. megatron-core is taken from wheels in .whl/
# when it is not installed there; fetch it beforehand on a machine with a package index:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
#
# Then, on the GPU machine, from the checkout:   bash tools/gpu_check.sh
# With vLLM's GPU build in an environment of its own (no network: built beforehand),
# also check sleep/wake around a streamed weight sync:
#   bash tools/gpu_check.sh --vllm-python /path/to/vllm-env/bin/python
# It finishes in a few minutes and ends with a table; exit 0 when nothing failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import megatron.core" 2>/dev/null && ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gyre-gpu-site .whl/megatron_core-*.whl || exit 1
  export PYTHONPATH="/tmp/gyre-gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
exec timeout 540 "$PY" tools/gpu_check.py "$@"
