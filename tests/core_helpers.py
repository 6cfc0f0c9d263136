"""A worker core's spec for tests: the worker's settings are a ``WorkerConfig`` (its defaults) with
prefix caching off unless asked, and the block count and context limit given directly."""

from __future__ import annotations

from typing import Any

from pdfabric.worker.spec import CoreSpec
from pdfabric.worker_config import WorkerConfig


def core_spec(
    kind: str, num_blocks: int = 64, *, max_model_len: int = 4096, worker_id: str = "",
    kv_bytes_per_token: int = 0, **config: Any,
) -> CoreSpec:  # fmt: skip
    config.setdefault("prefix_caching", False)
    return CoreSpec(
        config=WorkerConfig(kind=kind, **config), worker_id=worker_id or f"{kind}-0",
        num_blocks=num_blocks, max_model_len=max_model_len, kv_bytes_per_token=kv_bytes_per_token,
    )  # fmt: skip
