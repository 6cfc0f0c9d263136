"""Weights a worker quantizes as it starts (``quantization`` ``int8``, ``w8a8``, ``int4``, ``w4a8``; a
4-bit model's head in int8), kept in the model cache so that the next start reads them instead of
quantizing again (docs/engine.md#quantized-once-kept-in-the-model-cache).

``cached_quantizer(path, dtype)`` gives the packing (``ModelRunner(quantizer=...)``) a
``weight_forms.Quantizer`` whose forms live in ``$PDFABRIC_CACHE_DIR/quantized/<model>-<key>/``, one
safetensors file a layer and form (``model.layers.0.mlp.down_proj.int4.safetensors``). The key names
everything the forms depend on: the checkpoint's weight files (path, size, modification time), the
compute dtype and ``FORMAT`` (raised whenever a quantization rule changes). A layer missing there is
quantized and written, each file under a temporary name and then renamed into place, so a start
killed mid-way leaves whole files only and the next start computes the rest. A file that cannot be
read, or holds another shape, is quantized again and replaced, with a warning. Where the cache
cannot be written (a read-only directory, a full disk), the forms are still computed and served.

On disk an int4 layer takes about half a byte a weight (two levels a byte, plus a scale and an
offset per 32 weights), an int8 one a byte a weight.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from safetensors.torch import load_file, save_file

from pdfabric import envs
from pdfabric.engine.loader import checkpoint_files
from pdfabric.kernels.quantized import GroupedWeight
from pdfabric.kernels.weight_forms import Int8Form, Quantizer

if TYPE_CHECKING:
    from pdfabric.engine.model import LlamaForCausalLM

log = logging.getLogger("pdfabric.engine.quantized_cache")

FORMAT = 1  # of the files and of the quantization rules they hold (quantize_int8, quantize_int4)
_Form = TypeVar("_Form", Int8Form, GroupedWeight)


class CachedQuantizer(Quantizer):
    """A ``Quantizer`` that reads each layer's form from ``root`` and writes there what it computes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.read = self.written = 0  # layers' forms read from the cache, and computed and written
        self._writable = True

    def int8(self, name: str, weight: torch.Tensor) -> Int8Form:
        held = self._load(name, "int8", weight.shape, _int8_form)
        if held is not None:
            return held
        q, scale = super().int8(name, weight)
        self._save(name, "int8", {"q": q, "scale": scale})
        return q, scale

    def int4(self, name: str, weight: torch.Tensor) -> GroupedWeight:
        held = self._load(name, "int4", weight.shape, _int4_form)
        if held is not None:
            return held
        grouped = super().int4(name, weight)
        self._save(
            name,
            "int4",
            {"q": _pack_nibbles(grouped.q), "scales": grouped.scales, "offsets": grouped.offsets},
        )
        return grouped

    def _file(self, name: str, form: str) -> Path:
        return self.root / f"{name}.{form}.safetensors"

    def _load(self, name: str, form: str, shape: torch.Size, build: Callable[[dict], _Form]) -> _Form | None:
        """``name``'s ``form`` built from its file, if the cache holds one for a weight of ``shape``."""
        file = self._file(name, form)
        if not file.is_file():
            return None
        try:
            held = build(load_file(str(file)))
            got = held.shape if isinstance(held, GroupedWeight) else tuple(held[0].shape)
            if tuple(got) != tuple(shape):
                raise ValueError(f"it holds a {got} weight for a {tuple(shape)} layer")
        except Exception as e:  # a torn or foreign file: computed again and replaced
            log.warning("quantized weights in %s are unreadable (%s); quantizing again", file, e)
            return None
        self.read += 1
        return held

    def _save(self, name: str, form: str, tensors: dict[str, torch.Tensor | None]) -> None:
        if not self._writable:
            return
        whole = {key: t.contiguous() for key, t in tensors.items() if t is not None}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
            os.close(fd)
            try:
                save_file(whole, tmp, metadata={"format": "pt", "pdfabric_quantized": str(FORMAT)})
                os.replace(tmp, self._file(name, form))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            self._writable = False  # served all the same; said once
            log.warning(
                "cannot keep quantized weights in %s (%s): the next start quantizes again", self.root, e
            )
            return
        self.written += 1


# the settings whose weights are quantized as a worker starts
QUANTIZED_AT_LOAD = ("int8", "w8a8", "int4", "w4a8")


def quantizer_for(path: Path, model: LlamaForCausalLM, quantization: str) -> CachedQuantizer | None:
    """The cached quantizer for ``model`` (loaded from ``path``) where ``quantization`` quantizes its
    weights as it is packed on a CPU; None elsewhere (nothing to keep, or another device's kernels)."""
    weight = model.model.norm.weight
    if quantization not in QUANTIZED_AT_LOAD or weight.device.type != "cpu":
        return None
    return cached_quantizer(path, weight.dtype)


def cached_quantizer(path: Path, dtype: torch.dtype, cache_dir: str | Path | None = None) -> CachedQuantizer:
    """The quantizer whose forms are kept for the checkpoint at ``path`` computed in ``dtype``."""
    files = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in checkpoint_files(path)]
    identity = json.dumps([files, str(dtype), FORMAT]).encode()
    key = hashlib.sha256(identity).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).resolve().name)[:64]
    root = Path(cache_dir or envs.get("PDFABRIC_CACHE_DIR")) / "quantized" / f"{slug}-{key}"
    return CachedQuantizer(root)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` levels 0..15 as ``[n, k / 2]`` bytes, the even input in the low nibble."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    q = torch.empty((n, 2 * half), dtype=torch.uint8)
    q[:, 0::2] = packed & 15
    q[:, 1::2] = packed >> 4
    return q


def _int8_form(tensors: dict[str, torch.Tensor]) -> Int8Form:
    q, scale = tensors["q"], tensors["scale"]
    if q.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
        raise ValueError("not an int8 weight with a float32 scale per row")
    return q, scale


def _int4_form(tensors: dict[str, torch.Tensor]) -> GroupedWeight:
    if tensors["q"].dtype != torch.uint8:
        raise ValueError("not 4-bit levels, two a byte")
    return GroupedWeight(_unpack_nibbles(tensors["q"]), tensors["scales"], tensors["offsets"], 4)
