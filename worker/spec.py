"""What a worker core is told about itself: its settings whole and what its process learnt at start
(``CoreSpec``), and where its step times go (``ProfileSource``). No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdfabric.control import Register
from pdfabric.profile import StepShape, WorkerProfile
from pdfabric.worker_config import WorkerConfig


@dataclass(frozen=True, kw_only=True)
class CoreSpec:
    """One worker's settings as its core, scheduler and registration use them: the ``WorkerConfig``
    whole (every limit and default is written there once) and the facts its process found at start.
    Build it with ``sized`` where a model's context and KV size are known (the worker, the simulator);
    tests may give the block count and context limit directly."""

    config: WorkerConfig
    worker_id: str
    num_blocks: int
    max_model_len: int  # tokens one sequence may hold: the model's limit, or what the blocks hold
    kv_bytes_per_token: int = 0
    pid: int = 0
    host: str = ""  # kvtransfer.transport.host_id() of the worker's machine ("": unknown)
    weight_bytes: int = 0  # its model's weights as held in memory (0: not measured)

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("CoreSpec needs a worker id")
        if self.num_blocks < 1 or self.max_model_len < 1:
            raise ValueError(
                f"{self.worker_id}: num_blocks and max_model_len must be at least 1, "
                f"got {self.num_blocks} and {self.max_model_len}"
            )
        if self.kv_bytes_per_token < 0 or self.pid < 0:
            raise ValueError(f"{self.worker_id}: kv_bytes_per_token and pid must be >= 0")

    @classmethod
    def sized(
        cls, config: WorkerConfig, *, worker_id: str, model_max_len: int, kv_bytes_per_token: int,
        pid: int = 0, host: str = "", weight_bytes: int = 0, draft_kv_bytes_per_token: int = 0,
    ) -> CoreSpec:  # fmt: skip
        """The spec of a worker whose model holds ``model_max_len`` positions and whose tokens take
        ``kv_bytes_per_token`` of cache, its weights ``weight_bytes``: as many blocks as
        ``config.kv_blocks`` gives, and a context limit no larger than those blocks hold, so that one
        sequence always fits on its own. A draft model with a cache of its own, as many blocks,
        takes ``draft_kv_bytes_per_token`` a token of the same budget."""
        num_blocks = config.kv_blocks(kv_bytes_per_token + draft_kv_bytes_per_token, weight_bytes)
        max_model_len = min(model_max_len, num_blocks * config.block_size)
        return cls(
            config=config, worker_id=worker_id, num_blocks=num_blocks, max_model_len=max_model_len,
            kv_bytes_per_token=kv_bytes_per_token, pid=pid, host=host, weight_bytes=weight_bytes,
        )  # fmt: skip

    @property
    def kind(self) -> str:
        return self.config.kind

    def registration(self, kv_endpoint: str, profile: WorkerProfile) -> Register:
        """What this worker tells the router when it joins."""
        c = self.config
        return Register(
            worker_id=self.worker_id, kind=c.kind, pool=c.pool, model=c.model,
            max_model_len=self.max_model_len, block_size=c.block_size, num_blocks=self.num_blocks,
            kv_endpoint=kv_endpoint, pid=self.pid, max_running=c.max_running,
            max_batch_tokens=c.max_batch_tokens, kv_bytes_per_token=self.kv_bytes_per_token,
            profile=profile, host=self.host, served=c.served, weights=c.quantization,
            speculate_below=c.speculative_below if c.speculative != "off" and c.kind != "prefill" else 0,
            weight_bytes=self.weight_bytes, kv_cache_dtype=c.kv_cache_dtype,
        )  # fmt: skip


class ProfileSource(Protocol):
    """Where step times go and the latency profile comes from (online fit, or a fixed profile)."""

    def observe(self, shape: StepShape, seconds: float) -> None: ...

    def profile(self, force: bool = False) -> WorkerProfile: ...


class FixedProfile:
    """A profile that does not learn (the simulator's workers step exactly as it says)."""

    def __init__(self, profile: WorkerProfile) -> None:
        self._profile = profile

    def observe(self, shape: StepShape, seconds: float) -> None:
        pass

    def profile(self, force: bool = False) -> WorkerProfile:
        return self._profile
