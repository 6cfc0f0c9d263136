"""Converts a Llama- or Qwen2-architecture GGUF file into a Hugging Face model directory.

A GGUF file (llama.cpp's format) holds the weights, often quantized, and the tokenizer, special tokens
and chat template as metadata. pdfabric serves it by converting it once: the ``gguf`` package reads
and dequantizes the tensors, which are written as float32 safetensors under Hugging Face names; the
metadata becomes ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json``. The directory then loads through the normal loader
(:func:`pdfabric.engine.loader.load_model`) like any other checkpoint.

The quantized blocks of the tensors whose type pdfabric multiplies as it is (``GGUF_TYPES`` in
``kernels/quantized.py``) are kept too, byte for byte, in ``quantized.safetensors`` (one uint8 row of
blocks per output, under the tensor's Hugging Face name; their types in the file's metadata), so that
a worker with ``quantization = "gguf"`` serves the file's own weights (``load_model``).

Three things differ from a Hugging Face checkpoint:

* llama.cpp's converter permutes the rows of ``q_proj`` and ``k_proj`` of each head of a llama file
  so that its rotary embedding can rotate adjacent pairs; Hugging Face's Llama rotates the two halves
  of a head. The permutation is undone here (:func:`unpermute_rotary_rows`); a qwen2 file's rows are
  as Hugging Face's (its q/k/v biases come along).
* Llama 3.1's rotary scaling comes as a divisor per frequency (a ``rope_freqs`` tensor) rather than as
  parameters: it is written to ``config.json`` as ``rope_freq_factors``, which pdfabric's config
  reads (``ModelConfig.rope_freq_factors``); a Hugging Face loader would not.
* A GGUF "gpt2" tokenizer is a byte-level BPE given as its vocabulary and merges; the pre-tokenizer
  is named (``tokenizer.ggml.pre``) rather than stored, so the names this module knows map to the
  split rules llama.cpp applies for them. A "llama" tokenizer (SentencePiece's BPE) is given as
  pieces and scores: its merges are made from the scores (a pair's rank is the score of the piece it
  makes, as llama.cpp merges).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# GGUF token types (llama.cpp's llama_token_type): control tokens are special, user-defined ones are
# added tokens that are not special.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# Byte-level pre-tokenizers by GGUF name (llama.cpp's names): the split rule before bytes become
# symbols, and whether a word found whole in the vocabulary skips the merges (Llama 3's
# "ignore_merges"). Rules: "digits": digits one by one, then GPT-2's regex; "gpt2": GPT-2's regex;
# otherwise the regex given (the tokenizer.json ones of Llama 3 and Qwen2, which split numbers into
# runs of up to 3 digits and into single digits). Checked against llama.cpp's own vocabulary tests
# (tests/test_gguf_tokenizers.py).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_TOKENIZERS = {
    "smollm": ("digits", False), "starcoder": ("digits", False), "refact": ("digits", False),
    "gpt-2": ("gpt2", False), "gpt2": ("gpt2", False), "default": ("gpt2", False),
    "llama-bpe": (_LLAMA3_SPLIT, True), "llama3": (_LLAMA3_SPLIT, True), "llama-v3": (_LLAMA3_SPLIT, True),
    "qwen2": (_QWEN2_SPLIT, False), "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}  # fmt: skip

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # GGUF's name: Hugging Face's
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


QUANTIZED_FILE = "quantized.safetensors"  # a converted file's own blocks (module docstring)


class GGUFError(ValueError):
    """The GGUF file is not one this converter can serve (architecture, tokenizer, tensor types)."""


def convert_gguf(gguf_path: str | Path, out: str | Path, torch_dtype: str = "bfloat16") -> None:
    """Writes the Hugging Face model directory of ``gguf_path`` into ``out`` (which must exist).

    ``torch_dtype`` is the compute dtype recorded in ``config.json``; the weights are stored as the
    exact float32 dequantization either way.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    out = Path(out)
    config = hf_config(meta, torch_dtype)
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    _write_weights(reader, config, out / "model.safetensors")
    _write_blocks(reader, config, out / QUANTIZED_FILE)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _write_tokenizer(meta, out)


def _metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = field.contents()
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        known = " and ".join(repr(a) for a in _ARCHITECTURES)
        raise GGUFError(f"GGUF architecture {arch!r} is not served; pdfabric converts {known} files")
    return meta


def hf_config(meta: dict[str, Any], torch_dtype: str) -> dict[str, Any]:
    """``config.json`` of a llama or qwen2 GGUF file's metadata (keys under the architecture's name)."""
    arch = meta.get("general.architecture", "llama")
    hidden = int(meta[f"{arch}.embedding_length"])
    heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    if head_dim != hidden // heads:
        raise GGUFError(f"partial rotary embeddings (rope dimension {head_dim}) are not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": torch_dtype,
    }


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: within each head, rows ``0, 2, 4, ...`` (the first
    element of each rotated pair) go back to the head's first half and ``1, 3, 5, ...`` to its second."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")  # e.g. blk.3.attn_q, weight
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    elif stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    raise GGUFError(f"unexpected GGUF tensor {gguf_name!r} in a llama or qwen2 file")


def _hf_rows(gguf_name: str, rows: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """A tensor's rows (one per output) in Hugging Face's order: a llama file's q and k rows
    unpermuted (a qwen2 file's rotate halves, as Hugging Face's do)."""
    if config["model_type"] != "llama":
        return rows
    if ".attn_q." in gguf_name:
        return unpermute_rotary_rows(rows, config["num_attention_heads"])
    if ".attn_k." in gguf_name:
        return unpermute_rotary_rows(rows, config["num_key_value_heads"])
    return rows


def _write_weights(reader: Any, config: dict[str, Any], path: Path) -> None:
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name.endswith("rope_freqs.weight"):  # Llama 3.1's scaling as a divisor per frequency
            config["rope_freq_factors"] = [float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1)]
            continue
        try:
            weight = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise GGUFError(f"tensor {t.name}: {exc}") from None
        weight = _hf_rows(t.name, weight.reshape(tuple(reversed(t.shape.tolist()))), config)
        # A copy: unquantized tensors are views of the read-only file mapping.
        tensors[_hf_name(t.name)] = torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_blocks(reader: Any, config: dict[str, Any], path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from pdfabric.kernels.quantized import GGUF_TYPES

    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in GGUF_TYPES:
            continue
        # [outputs, bytes of one output's blocks]: the blocks run along the inputs, so rows move whole
        blocks = _hf_rows(t.name, np.asarray(t.data), config)
        name = _hf_name(t.name)
        tensors[name] = torch.from_numpy(np.array(blocks, dtype=np.uint8, order="C"))
        types[name] = t.tensor_type.name
    save_file(tensors, str(path), metadata={"format": "pt", "gguf_types": json.dumps(types)})


def _pre_tokenizer_steps(rule: str) -> list[Any]:
    """The ``tokenizers`` pre-tokenizer steps of a split rule (``_PRE_TOKENIZERS``), ending with the
    byte-level mapping."""
    from tokenizers import Regex, pre_tokenizers

    if rule in ("digits", "gpt2"):
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if rule == "digits":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        return steps
    return [
        pre_tokenizers.Split(Regex(rule), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> Any:
    """A GGUF "gpt2" vocabulary as a ``tokenizers`` byte-level BPE with its pre-tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        known = ", ".join(sorted(_PRE_TOKENIZERS))
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not known; known: {known}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]  # none: bytes only
    rule, ignore_merges = _PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(_pre_tokenizer_steps(rule))
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> Any:
    """A GGUF "llama" vocabulary (SentencePiece's BPE: Llama 2, Mistral, TinyLlama) as a ``tokenizers``
    BPE: a space prefix and spaces as "▁", bytes outside the vocabulary as <0xXX> tokens, and merges
    ranked by the score of the piece they make (llama.cpp merges the pair whose piece scores highest)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores: list[float] = [float(s) for s in meta["tokenizer.ggml.scores"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[int(unk)] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )  # fmt: skip
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return backend


def _write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens)
    else:
        raise GGUFError(
            f"GGUF tokenizer model {kind!r} is not supported; pdfabric converts 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece BPE)"
        )
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
    )
    backend.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    generation = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
