"""Loads a Hugging Face safetensors checkpoint (single file or sharded) into ``LlamaForCausalLM``.

The model is built on the meta device and the checkpoint's tensors are assigned to it by name, so
weights exist in memory once; the parts of a stacked projection (``model.stacked_shards``: q, k, v
into ``qkv_proj``, gate and up into ``gate_up_proj``) are copied into their rows of one tensor. Every
expected tensor must be present with the expected shape; anything missing, misshapen or unknown is
an error that names it.

With ``quantization="gguf"`` the blocks a converted GGUF file kept (``gguf_checkpoint``) are handed
to the layers they belong to (``gguf_blocks``, what ``kernels/linear_cpu.py`` packs; a tied head's on
the model as ``tied_head_blocks``), a stacked projection's parts stacked when their formats agree,
and given part by part (``gguf_parts``: each part's blocks, or None for a part in the compute dtype)
when they do not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.model import LlamaForCausalLM, stacked_shards
from pdfabric.kernels.cpu_build import cpu_has_half_math

log = logging.getLogger("pdfabric.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Older checkpoints carry rotary tables; they are derived from the config, so they are skipped.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, in shard order."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shard(s) missing in {path}: {', '.join(missing)}")
    return files


def checkpoint_places(model: LlamaForCausalLM) -> dict[str, tuple[str, slice]]:
    """Each checkpoint tensor's place in ``model``: its parameter's name and rows (all rows, except
    for the parts of a stacked projection)."""
    stacked = stacked_shards(model.config)
    places: dict[str, tuple[str, slice]] = {}
    for name, p in model.named_parameters():
        module, _, kind = name.rpartition(".")  # e.g. model.layers.0.self_attn.qkv_proj, weight
        prefix, _, leaf = module.rpartition(".")
        if leaf not in stacked:
            places[name] = (name, slice(0, p.shape[0]))
            continue
        start = 0
        for part, rows in stacked[leaf]:
            places[f"{prefix}.{part}.{kind}"] = (name, slice(start, start + rows))
            start += rows
    return places


def load_model(
    path: str | Path,
    dtype: str | None = None,
    device: str | torch.device = "cpu",
    quantization: str = "none",
) -> LlamaForCausalLM:
    """Builds the model described by ``path/config.json`` and loads its weights.

    ``dtype`` overrides the checkpoint's ``torch_dtype`` (float32, bfloat16 or float16). Without it, a
    half-precision checkpoint is computed in float32 on a CPU that lacks native half-precision math.
    ``quantization``: a worker's setting of that name; ``gguf`` also reads the file's own blocks, as
    ``w4a8`` does where the model was converted from a GGUF file.
    """
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path, dtype)
    on_cpu = torch.device(device).type == "cpu"
    if dtype is None and on_cpu and cfg.dtype != "float32" and not cpu_has_half_math():
        # Half-precision matmuls are emulated on such CPUs and run an order of magnitude slower.
        log.info("%s: computing in float32 (this CPU has no native %s matmul)", path.name, cfg.dtype)
        cfg = dataclasses.replace(cfg, dtype="float32")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    places = checkpoint_places(model)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    target = DTYPES[cfg.dtype]
    state: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in places:
                    raise CheckpointError(f"{file.name}: unexpected tensor {name!r} for {cfg.architecture}")
                param, rows = places[name]
                tensor = f.get_tensor(name)
                expected = (rows.stop - rows.start, *shapes[param][1:])
                if tensor.shape != expected:
                    raise CheckpointError(
                        f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                    )
                if expected == tuple(shapes[param]):  # a whole parameter: no copy if dtype and device match
                    state[param] = tensor.to(device=device, dtype=target)
                else:  # one part of a stacked projection: into its rows
                    whole = state.setdefault(param, torch.empty(shapes[param], dtype=target, device=device))
                    whole[rows] = tensor.to(device=device, dtype=target)
                seen.add(name)
    missing = sorted(set(places) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint in {path} lacks tensor(s): {shown}")
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = model.inv_freq.to(device)
    if quantization in ("gguf", "w4a8"):  # (w4a8 takes a GGUF file's 4-bit blocks as they are)
        _attach_gguf_blocks(model, path, places, required=quantization == "gguf")
    return model.eval().requires_grad_(False)


def _attach_gguf_blocks(
    model: LlamaForCausalLM, path: Path, places: dict[str, tuple[str, slice]], required: bool = True
) -> None:
    """Gives the layers the blocks of the GGUF file the model was converted from; a model converted
    from none has none (a ``CheckpointError`` where they are ``required``)."""
    from pdfabric.engine.gguf_checkpoint import QUANTIZED_FILE
    from pdfabric.kernels.quantized import GroupedWeight, from_gguf

    file = path / QUANTIZED_FILE
    if not file.is_file():
        if not required:
            return
        raise CheckpointError(
            f"quantization 'gguf' serves a model converted from a GGUF file; {path} has no {QUANTIZED_FILE}"
        )
    shapes = {name: p.shape for name, p in model.named_parameters()}
    parts: dict[str, list[tuple[int, GroupedWeight]]] = {}
    with safe_open(str(file), framework="np", device="cpu") as f:
        types = json.loads((f.metadata() or {}).get("gguf_types", "{}"))
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            if name not in places or name not in types:
                raise CheckpointError(f"{file.name}: unexpected tensor {name!r}")
            param, rows = places[name]
            shape = (rows.stop - rows.start, shapes[param][1])
            blocks = from_gguf(types[name], f.get_tensor(name), shape)
            parts.setdefault(param, []).append((rows.start, blocks))
    wanted = {
        param: sorted((rows.start, rows.stop) for p, rows in places.values() if p == param) for param in parts
    }
    for param, found in parts.items():
        module = param.rpartition(".")[0]
        held = dict(found)
        blocks = None
        if sorted(held) == [start for start, _ in wanted[param]]:
            blocks = GroupedWeight.stack([held[start] for start, _ in wanted[param]])
        if blocks is None and len(wanted[param]) > 1:  # a stacked projection of mixed formats: by parts
            model.get_submodule(module).gguf_parts = tuple(
                (stop - start, held.get(start)) for start, stop in wanted[param]
            )
            continue
        if blocks is None:
            continue
        if module == "model.embed_tokens":  # a tied head's (the packed head then serves the lookup)
            model.tied_head_blocks = blocks if model.lm_head is None else None
        else:
            model.get_submodule(module).gguf_blocks = blocks
