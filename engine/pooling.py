"""How a checkpoint turns its last hidden states into one embedding vector (no torch here).

A checkpoint made for embeddings says so the sentence-transformers way: ``modules.json`` lists a
``Pooling`` module (its ``config.json`` names the mode) and, where the vectors are unit length, a
``Normalize`` module. A checkpoint without those (a Llama-family model used for embeddings) pools
its last token's hidden state and normalizes it, as decoder-only embedding models are trained to.
``config.json``'s ``matryoshka_dimensions`` lists the sizes a vector may be cut to (the OpenAI
``dimensions`` field); without it a vector is served whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODES = ("last", "mean", "cls")
# sentence-transformers' Pooling config key of each mode computed here (max, weighted and sqrt-length
# means are not)
_ST_MODES = {
    "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
}  # fmt: skip
_ST = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooling:
    """A model's pooling: ``mode`` (``last`` token, ``mean`` of every token, ``cls``: the first), whether
    the vector is scaled to unit length, and the sizes it may be cut to (empty: none)."""

    mode: str = "last"
    normalize: bool = True
    dimensions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if any(d < 1 for d in self.dimensions):
            raise ValueError(f"matryoshka dimensions must be >= 1, got {self.dimensions}")


def declared_pooling(model_dir: Path) -> Pooling:
    """The pooling ``model_dir`` declares; ``ValueError`` for one it declares that is not computed here
    (max or weighted pooling, several modes at once, a dense layer after the pooling)."""
    dims = _matryoshka(model_dir / "config.json")
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return Pooling("last", True, dims)
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    extra = [
        t for t in types if t.startswith(_ST) and t[len(_ST) :] not in ("Transformer", "Pooling", "Normalize")
    ]
    if extra:
        raise ValueError(f"{modules_file}: modules {extra} are not computed by pdfabric")
    pooling = [m for m in modules if m.get("type") == _ST + "Pooling"]
    mode = "last"
    if pooling:
        cfg = json.loads((model_dir / pooling[0].get("path", "") / "config.json").read_text())
        on = [key for key, value in cfg.items() if key.startswith("pooling_mode_") and value is True]
        if len(on) != 1 or on[0] not in _ST_MODES:
            raise ValueError(f"{model_dir}: pooling {on} is not one of {', '.join(_ST_MODES)}")
        mode = _ST_MODES[on[0]]
    return Pooling(mode, _ST + "Normalize" in types, dims)


def _matryoshka(config_file: Path) -> tuple[int, ...]:
    if not config_file.exists():
        return ()
    dims = json.loads(config_file.read_text()).get("matryoshka_dimensions") or ()
    return tuple(sorted(int(d) for d in dims))
