"""A GGUF file given by its path (``--model ./model.gguf``): converted once into the model cache, anew
when the file changes, and served as the weights it holds. The file here is written by the ``gguf``
package's writer from the ``tiny`` preset's float32 weights (q and k rows permuted as llama.cpp's
converter does, a byte-level BPE vocabulary of the same 260 ids), so the converted model must answer
exactly what ``tiny`` answers."""

from __future__ import annotations

import json
import math
import os
import shutil
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
_GLOBAL = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "rope_freqs": "rope_freqs",
}  # fmt: skip


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: byte-level BPE's tokens for the 256 bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_gguf(
    path: Path,
    cfg: dict,
    weights: dict[str, np.ndarray],
    k_blocks: dict[str, tuple[str, np.ndarray]] | None = None,
    quantize: dict[str, str] | None = None,
    arch: str = "llama",
) -> None:
    """A GGUF file of ``arch`` of Hugging Face ``weights`` in float32 (a llama file's q and k rows
    permuted as llama.cpp's converter does), ``quantize``'s tensors quantized by the ``gguf`` package
    to the type named, and ``k_blocks``' tensors as the blocks given of the K-quant type named (one row of
    blocks an output)."""
    k_blocks, quantize = k_blocks or {}, quantize or {}
    writer = gguf.GGUFWriter(str(path), arch)
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
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    for name, tensor in {**weights, **{n: blocks for n, (_, blocks) in k_blocks.items()}}.items():
        stem, _, kind = name.rpartition(".")
        if stem.startswith("model.layers."):
            layer, part = stem.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_LAYER[part]}.{kind}"
        else:
            gguf_name = f"{_GLOBAL[stem]}.{kind}"
        if name in k_blocks:
            writer.add_tensor(gguf_name, tensor, raw_dtype=gguf.GGMLQuantizationType[k_blocks[name][0]])
            continue
        part = gguf_name.split(".")[-2]
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(part)
        if heads and arch == "llama":
            tensor = _llama_cpp_permute(tensor, heads)
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if name in quantize:
            kind = gguf.GGMLQuantizationType[quantize[name]]
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gguf(path: Path) -> None:
    """The ``tiny`` preset as a llama GGUF file, every tensor in float32."""
    source = resolve_model("tiny")
    cfg = json.loads((source / "config.json").read_text())
    write_gguf(path, cfg, load_file(str(source / "model.safetensors")))


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


def test_a_files_rotary_frequency_factors_are_llama3_scaling(tmp_path: Path) -> None:
    """Llama 3.1's GGUF files carry their rotary scaling as a divisor per frequency (rope_freqs, made by
    llama.cpp's converter from the rope_scaling parameters): served, the file answers what the Hugging
    Face checkpoint with those parameters answers."""
    source = resolve_model("tiny")
    cfg = json.loads((source / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    scaled_dir = tmp_path / "scaled"
    shutil.copytree(source, scaled_dir)
    (scaled_dir / "config.json").write_text(json.dumps({**cfg, "rope_scaling": scaling}))
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    factors = []  # llama.cpp's conversion of the parameters (conversion/llama.py)
    for freq in 1.0 / cfg["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen, old = 2 * math.pi / freq, scaling["original_max_position_embeddings"]
        if wavelen < old / scaling["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > old / scaling["low_freq_factor"]:
            factors.append(scaling["factor"])
        else:
            smooth = (old / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    assert len(set(factors)) > 2  # kept, blended and slowed frequencies all present
    path = tmp_path / "scaled-rope.gguf"
    weights = load_file(str(source / "model.safetensors"))
    write_gguf(path, cfg, {**weights, "rope_freqs.weight": np.array(factors, dtype=np.float32)})
    prompt, params = list(range(10, 110)), SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1)
    want = ReferenceEngine(str(scaled_dir)).generate(prompt, params)
    got = ReferenceEngine(str(path), dtype="float32").generate(prompt, params)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    unscaled = ReferenceEngine("tiny").generate(prompt, params)
    assert unscaled.logprobs != pytest.approx(want.logprobs, abs=1e-4)  # the scaling matters here


def test_a_failed_conversion_leaves_no_entry(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(Exception):  # noqa: B017 - whatever the reader raises on a truncated file
        ensure_gguf(bad)
    root = Path(os.environ["PDFABRIC_CACHE_DIR"]) / "models"
    assert not list(root.glob("gguf-not-a-model-*")) and not list(root.glob(".gguf-not-a-model-*.staging-*"))
    with pytest.raises(FileNotFoundError, match="neither a directory, a .gguf file nor a built-in preset"):
        resolve_model(str(tmp_path / "missing.gguf"))


def _k_blocks(rng: np.random.Generator, kind: str, n: int, k: int) -> tuple[str, np.ndarray]:
    """Random ``kind`` (Q3_K or Q6_K) blocks of an ``[n, k]`` weight, each super-block's d small."""
    size = {"Q3_K": 110, "Q6_K": 210}[kind]  # d is a super-block's last two bytes in both
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    raw[..., size - 2 :] = np.full((n, k // 256, 1), 2e-5, np.float16).view(np.uint8)
    return kind, raw.reshape(n, k // 256 * size)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_gguf_files_q5_q3_k_and_q6_k_tensors_are_multiplied_as_they_are(
    tmp_path: Path, mixed: bool
) -> None:
    """Q5_0, Q5_1, Q3_K and Q6_K tensors (what Q4_K_M, Q5_K_M and Q3_K_M files use) are served in their
    own blocks under ``--quantization gguf``: the layers hold them (8 bits; Q5_1 with offsets; Q3_K and
    Q6_K in groups of 16), a stacked projection whose parts differ (``mixed``: q and k in Q5_1 beside
    v in Q6_K; gate in Q5_0 beside up in float32) part by part, and the answers are those of the
    file's weights dequantized to float32."""
    cfg = {"num_hidden_layers": 2, "max_position_embeddings": 1024, "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rope_theta": 10000.0, "rms_norm_eps": 1e-5}  # fmt: skip
    rng = np.random.default_rng(5)
    hidden, inter, kv = 256, 512, 2 * 64
    shapes = {"model.embed_tokens.weight": (260, hidden), "lm_head.weight": (260, hidden),
              "model.norm.weight": (hidden,)}  # fmt: skip
    in_k = {
        "self_attn.o_proj": "Q6_K",
        "mlp.down_proj": "Q3_K",
        **({"self_attn.v_proj": "Q6_K"} if mixed else {}),
    }
    k_blocks = {}
    for layer in range(2):
        pre = f"model.layers.{layer}."
        shapes |= {
            pre + "input_layernorm.weight": (hidden,),
            pre + "post_attention_layernorm.weight": (hidden,),
        }
        for name, (n, k) in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (kv, hidden)),
                             ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                             ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                             ("mlp.down_proj", (hidden, inter))):  # fmt: skip
            if name in in_k:
                k_blocks[pre + name + ".weight"] = _k_blocks(rng, in_k[name], n, k)
            else:
                shapes[pre + name + ".weight"] = (n, k)
    weights = {
        name: (np.ones(shape) if len(shape) == 1 else rng.standard_normal(shape) * 0.05).astype(np.float32)
        for name, shape in shapes.items()
    }
    if mixed:
        kinds = {
            n: "Q5_0" if "gate" in n else "Q5_1"
            for n in weights
            if n.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight"))
        }
    else:
        kinds = {n: "Q5_0" if ".self_attn." in n else "Q5_1" for n in weights if n.endswith("proj.weight")}
    path = tmp_path / "q5-q6k.gguf"
    write_gguf(path, cfg, weights, k_blocks, kinds)
    held = ReferenceEngine(str(path), dtype="float32", quantization="gguf")
    plain = ReferenceEngine(str(path), dtype="float32")
    layer = held.model.model.layers[0]
    assert (layer.self_attn.o_proj.bits, layer.self_attn.o_proj.group) == (8, 16)
    assert (layer.mlp.down_proj.bits, layer.mlp.down_proj.group) == (8, 16)
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    if mixed:  # pd_linear's dtype 16: each part in its own format (None: float32)
        assert (qkv.dtype_code, qkv.parts) == (16, ((hidden, 8), (kv, 8), (kv, 8)))
        assert (gate_up.dtype_code, gate_up.parts) == (16, ((inter, 8), (inter, None)))
        assert held.runner.decoder is not None  # decode steps still run all layers in one C call
    else:
        assert (qkv.bits, qkv.group, gate_up.bits, gate_up.group) == (8, 32, 8, 32)
        assert (qkv.dtype_code, gate_up.dtype_code) == (7, 13)  # float32 x; Q5_1's offsets
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    a, b = held.generate(list(range(20, 60)), params), plain.generate(list(range(20, 60)), params)
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_w4a8_takes_a_gguf_files_4_bit_blocks_as_they_are(tmp_path: Path) -> None:
    """Under ``--quantization w4a8`` a GGUF file's Q4_0 and Q4_1 tensors are held as the file has them
    (not dequantized and quantized again) and multiplied by int8 activations: each such layer gives
    ``w4a8_reference`` over the file's blocks to the bit; a tensor in another format (Q8_0) is
    quantized to int4 as for any checkpoint."""
    import torch

    from pdfabric.engine.loader import load_model
    from pdfabric.kernels.w8a8_ref import w4a8_reference
    from pdfabric.kernels.weight_forms import grouped_form

    source = resolve_model("tiny")
    cfg = json.loads((source / "config.json").read_text())
    weights = load_file(str(source / "model.safetensors"))
    # tiny's down projection has 176 inputs, not groups of 32: it stays in float32
    grouped = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
    kinds = {n: "Q4_1" if "self_attn" in n else "Q4_0" for n in weights if n.split(".")[-2] in grouped}
    kinds["model.layers.0.self_attn.o_proj.weight"] = "Q8_0"
    path = tmp_path / "q4.gguf"
    write_gguf(path, cfg, weights, quantize=kinds)
    model = load_model(ensure_gguf(path), "float32", quantization="w4a8")
    layer = model.model.layers[0]
    qkv, o, gate_up = layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj
    assert grouped_form(qkv, "w4a8") is qkv.gguf_blocks and qkv.gguf_blocks.bits == 4
    assert grouped_form(gate_up, "w4a8") is gate_up.gguf_blocks and gate_up.gguf_blocks.bits == 4
    assert o.gguf_blocks.bits == 8 and grouped_form(o, "w4a8").bits == 4  # quantized to int4
    held = ReferenceEngine(str(path), dtype="float32", quantization="w4a8")
    x = torch.randn(7, cfg["hidden_size"])
    packed = held.model.model.layers[0].self_attn.qkv_proj
    assert packed.quantization == "w4a8" and torch.equal(packed(x), w4a8_reference(x, qkv.gguf_blocks, None))
    out = held.generate(list(range(20, 50)), SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 8


def test_a_qwen2_gguf_file_answers_what_its_checkpoint_answers(tmp_path: Path) -> None:
    """A qwen2 GGUF file (q/k/v biases, rows as Hugging Face keeps them, a tied head) converted and
    served in float32 gives the logits of the Hugging Face Qwen2 checkpoint it was written from."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.Qwen2Config(
        vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=1e6,
    )  # fmt: skip
    torch.manual_seed(4)
    hf = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # biases start at zero; make them matter
    checkpoint = tmp_path / "qwen2"
    hf.float().save_pretrained(checkpoint)
    shutil.copy(resolve_model("tiny") / "tokenizer.json", checkpoint)
    weights = {n: p.detach().float().numpy() for n, p in hf.state_dict().items() if n != "lm_head.weight"}
    cfg = {"num_hidden_layers": 2, "max_position_embeddings": 1024, "hidden_size": 128,
           "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e6,
           "rms_norm_eps": config.rms_norm_eps}  # fmt: skip
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, cfg, weights, arch="qwen2")
    converted = ensure_gguf(path)
    assert json.loads((converted / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    prompt, params = list(range(10, 70)), SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    want = ReferenceEngine(str(checkpoint), dtype="float32").generate(prompt, params)
    got = ReferenceEngine(str(path), dtype="float32").generate(prompt, params)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
