"""A GGUF file given by its path (``--model ./model.gguf``): converted once into the model cache, anew
when the file changes, and served as the weights it holds. The file here is written by the ``gguf``
package's writer from the ``tiny`` preset's float32 weights (q and k rows permuted as llama.cpp's
converter does, a byte-level BPE vocabulary of the same 260 ids), so the converted model must answer
exactly what ``tiny`` answers."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pdfabric.engine import default_model
from pdfabric.engine.default_model import ensure_gguf, resolve_model
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.test_gguf import _llama_cpp_permute

gguf = pytest.importorskip("gguf")

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: byte-level BPE's tokens for the 256 bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(path: Path) -> None:
    """The ``tiny`` preset as a llama GGUF file, every tensor in float32."""
    source = resolve_model("tiny")
    cfg = json.loads((source / "config.json").read_text())
    weights = load_file(str(source / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    specials = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
    writer.add_token_list([*_byte_tokens(), *specials])
    writer.add_token_types([1] * 256 + [3] * len(specials))  # normal, then control
    writer.add_token_merges([])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for name, tensor in weights.items():
        stem, _, kind = name.rpartition(".")
        if stem.startswith("model.layers."):
            layer, part = stem.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_LAYER[part]}.{kind}"
        else:
            gguf_name = f"{_GLOBAL[stem]}.{kind}"
        if part_heads := {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(
            gguf_name.split(".")[-2]
        ):
            tensor = _llama_cpp_permute(tensor, part_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny model.gguf"  # a space: the cache entry's name is made safe
    write_tiny_gguf(path)
    return path


def test_a_gguf_file_serves_the_weights_it_holds(gguf_file: Path) -> None:
    path = resolve_model(str(gguf_file))
    assert path.name.startswith("gguf-tiny-model-") and (path / "tokenizer.json").is_file()
    prompt = list(range(10, 70))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = ReferenceEngine("tiny").generate(prompt, params)
    got = ReferenceEngine(str(gguf_file), dtype="float32").generate(prompt, params)
    assert got.token_ids == want.token_ids


def test_a_gguf_file_is_converted_once_and_again_when_it_changes(
    gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted: list[Path] = []
    convert = default_model._convert

    def counting(source: Path, out: Path, torch_dtype: str) -> None:
        converted.append(source)
        convert(source, out, torch_dtype)

    monkeypatch.setattr(default_model, "_convert", counting)
    # started together, as a router and its workers are: one converts, the others wait and find it
    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(ensure_gguf(gguf_file))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(converted) == 1 and len(set(found)) == 1
    assert ensure_gguf(gguf_file) == found[0] and len(converted) == 1
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file was replaced
    again = ensure_gguf(gguf_file)
    assert again != found[0] and len(converted) == 2
    assert not list(again.parent.glob(".*.staging-*"))


def test_a_failed_conversion_leaves_no_entry(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(Exception):  # noqa: B017 - whatever the reader raises on a truncated file
        ensure_gguf(bad)
    root = Path(os.environ["PDFABRIC_CACHE_DIR"]) / "models"
    assert not list(root.glob("gguf-not-a-model-*")) and not list(root.glob(".gguf-not-a-model-*.staging-*"))
    with pytest.raises(FileNotFoundError, match="neither a directory, a .gguf file nor a built-in preset"):
        resolve_model(str(tmp_path / "missing.gguf"))
