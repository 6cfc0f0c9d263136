"""One worker's settings: ``WorkerConfig``, frozen and validated once, from a deployment's ``[worker]``
and ``[[workers]]`` tables, the command line, or the JSON a launcher hands a worker process."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from pdfabric.control import KINDS
from pdfabric.kv_config import CHOICES as KV_TRANSPORTS

# WorkerConfig fields a deployment's [worker] and [[workers]] tables may not set: the launcher fixes
# them per process (kind, join, worker_id) or takes them from [serve] (model, dtype).
_PER_PROCESS = frozenset({"kind", "join", "model", "dtype", "worker_id", "served"})


# kv_memory_mb = 0 (the default) sizes a worker's KV cache by its model: room for max_running
# sequences of AUTO_KV_TOKENS tokens each, and never less than AUTO_KV_MIN_MB. A fixed 256 MiB held
# about 11,000 SmolLM2 tokens (17 requests of 640): under load the scheduler preempted and recomputed
# and admission refused half the requests.
AUTO_KV_TOKENS = 1024
AUTO_KV_MIN_MB = 256

# The linear-layer kernels a worker may run (kernels/linear.py keeps the same names): "invariant" sums
# every output in one order whatever the batch (C on CPUs, Triton on CUDA); the vendor libraries,
# "onednn" on CPUs and "cublas" on CUDA, are faster on long prompts on a GPU but give a token other
# bits in another batch, so greedy text is no longer the same in every deployment (docs/serving.md).
LINEARS = ("invariant", "onednn", "cublas")
SPECULATIVE = ("off", "ngram", "draft")  # speculative decoding's proposers
DRAFT_CACHES = ("auto", "own")  # where a draft model's KV lives: the served cache where it can, or its own
# How linear weights may be held (kernels/linear_cpu.py), named here so that configs import no torch
QUANTIZATIONS = ("none", "int8", "int4", "gguf", "w8a8", "w4a8")
# What a KV-cache row is stored as (engine/kv_cache.py): "auto", the model's dtype; "int8", int8 values
# and a float32 scale per token and kv head (bfloat16 models on CPUs with AVX512-BF16 and AVX512-VNNI)
KV_CACHE_DTYPES = ("auto", "int8")
# Which blocks the host KV store's disk tier takes (kvtransfer/host_store.py)
STORE_ADMISSIONS = ("reused", "all")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process."""

    kind: str
    join: str = ""  # the router's control address, tcp://HOST:PORT
    model: str = "tiny"
    dtype: str | None = None
    pool: str = "default"
    worker_id: str = ""
    block_size: int = 16
    num_blocks: int = 0  # 0: as many as kv_memory_mb holds
    kv_memory_mb: int = 0  # 0: auto, sized by the model (see AUTO_KV_TOKENS)
    # the weights (as held: quantized or not) and the KV cache together; with kv_memory_mb = 0 the KV
    # cache gets what the weights leave, so fewer bits a weight mean more blocks (0: not set)
    memory_mb: int = 0
    max_batch_tokens: int = 512
    # how long a step may run background requests' prompts (a batch job's lines), all together, by the
    # worker's step-time profile (the tokens that fit, at least 16), in steps where no foreground
    # sequence decodes (none in the others), so that a foreground prompt that arrives waits for a
    # short step (0: no limit, background prompts are scheduled as any other)
    background_step_ms: float = 40.0
    max_running: int = 64
    kv_host: str = "127.0.0.1"  # address a decode worker binds its KV endpoint on
    heartbeat_s: float = 0.25
    drain_timeout_s: float = 30.0  # SIGTERM: exit once idle, or after this long (what is left fails over)
    device: str = "auto"  # auto (cuda when available, else cpu), cpu, cuda or cuda:N
    threads: int = 0  # torch threads (0: the launcher gives each worker its share of the cores)
    profile_seconds: float = 5.0  # start-up profiling budget (0: none; the profile is then learnt online)
    kv_transport: str = (
        "auto"  # auto (per pair: shm on one host, zmq across, dist when set up) | zmq | shm | dist
    )
    prefix_caching: bool = True  # keep computed full blocks for prompts that share their prefix
    linears: str = "invariant"  # the linear-layer kernel (LINEARS); a vendor one gives up batch invariance
    # How the linear layers' weights are held (QUANTIZATIONS), weight-only on CPUs: "int8", a scale per
    # output (half of bfloat16's bytes for a decode step to read); "int4", groups of 32 inputs;
    # "gguf", a GGUF model's own blocks as they are (Q4_0, Q4_1, Q4_K, Q8_0; other tensors in the
    # model's dtype); "none", the model's dtype. "w8a8" (CPUs): int8's weights times activations
    # quantized to int8 per row, integer products at twice bfloat16's rate (docs/engine.md#quantized-weights);
    # "w4a8" (CPUs): int4's weights times activations quantized the same way
    quantization: str = "none"
    # the KV cache's rows (KV_CACHE_DTYPES): "int8" halves the KV memory a token takes and the bytes
    # decode attention reads (docs/engine.md#int8-kv-cache); the same on a deployment's prefill and
    # decode workers, whose transfers move blocks as bytes
    kv_cache_dtype: str = "auto"
    # KV channel encrypted (CURVE) or, on a network the operator trusts, authenticated in the clear
    # (PLAIN); the same for every worker of a deployment, or its transfers fail (docs/security.md)
    kv_encryption: bool = True
    served: str = ""  # the model version it serves, "name@version" ("": the deployment's one model)
    # Speculative decoding on decode and colocated workers (docs/engine.md#speculative-decoding):
    # "ngram" proposes up to speculative_k tokens per sequence from its own history, "draft" drafts
    # them with draft_model (a checkpoint with the model's tokenizer; "": the model itself) held as
    # draft_quantization, while at most speculative_below sequences decode; "off": none. draft_layers
    # keeps the draft's first N decoder layers only (0: all): a shallower draft of the model itself.
    # draft_cache: "auto" drafts over the served model's KV cache where the draft's layers have its
    # layout, else over a cache of its own; "own" always over one of its own (a draft of other weights).
    speculative: str = "off"
    speculative_k: int = 10
    speculative_below: int = 4
    draft_model: str = ""
    draft_quantization: str = "int4"
    draft_layers: int = 0
    draft_cache: str = "auto"
    # The host KV store (the [kv_store] table; docs/kvtransfer.md#the-host-kv-store): blocks the pool
    # evicts go to a RAM tier (a directory in shared memory, "": /dev/shm/pdfabric-kv-store-UID) and a
    # disk tier, shared by the host's workers and kept across restarts; a prompt's cached prefix
    # continues there. 0 MiB: that tier is off. The disk takes a block the RAM tier lets go if it was
    # read back or offered twice ("reused"), or every one ("all"). Saves queue at most queue_mb (but
    # at least a longest prompt's blocks). With write_through, a pool block that serves a prompt again
    # (a hot prefix) is saved at once, not only when evicted: the host's other workers read it while
    # this one holds it, and a crash keeps it.
    kv_store_ram_mb: int = 0
    kv_store_ram_dir: str = ""
    kv_store_disk_dir: str = ""
    kv_store_disk_mb: int = 0
    kv_store_disk_admission: str = "reused"
    kv_store_queue_mb: int = 64
    kv_store_write_through: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"worker kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("block_size", "max_batch_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.memory_mb < 0:
            raise ValueError(f"memory_mb must be >= 0 (0: not set), got {self.memory_mb}")
        if not (math.isfinite(self.background_step_ms) and self.background_step_ms >= 0):
            raise ValueError(f"background_step_ms must be >= 0 (0: no limit), got {self.background_step_ms}")
        if self.kv_memory_mb < 0:
            raise ValueError(f"kv_memory_mb must be >= 0 (0: auto), got {self.kv_memory_mb}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_blocks < 0 or self.threads < 0:
            raise ValueError(f"num_blocks and threads must be >= 0, got {self.num_blocks}, {self.threads}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, got {self.heartbeat_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}"
            )

        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization != "none" and self.linears != "invariant":
            raise ValueError(
                f"quantization {self.quantization!r} runs on the invariant linears, not {self.linears!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}")
        if self.draft_quantization not in QUANTIZATIONS:
            formats = ", ".join(QUANTIZATIONS)
            raise ValueError(f"draft_quantization must be one of {formats}, got {self.draft_quantization!r}")
        if self.draft_cache not in DRAFT_CACHES:
            caches = ", ".join(DRAFT_CACHES)
            raise ValueError(f"draft_cache must be one of {caches}, got {self.draft_cache!r}")
        if self.draft_layers < 0:
            raise ValueError(
                f"draft_layers must be >= 0 (0: all of the draft's layers), got {self.draft_layers}"
            )
        if not 1 <= self.speculative_k <= 32 or self.speculative_below < 1:
            raise ValueError(
                f"speculative_k must be in [1, 32] and speculative_below at least 1, got "
                f"{self.speculative_k}, {self.speculative_below}"
            )
        if self.linears not in LINEARS:
            raise ValueError(f"linears must be one of {', '.join(LINEARS)}, got {self.linears!r}")
        self._check_kv_store()

    def _check_kv_store(self) -> None:
        if self.kv_store_ram_mb < 0 or self.kv_store_disk_mb < 0 or self.kv_store_queue_mb < 1:
            raise ValueError(
                "kv_store ram_mb and disk_mb must be >= 0 and queue_mb >= 1, got "
                f"{self.kv_store_ram_mb}, {self.kv_store_disk_mb}, {self.kv_store_queue_mb}"
            )
        if bool(self.kv_store_disk_mb) != bool(self.kv_store_disk_dir):
            raise ValueError("kv_store disk_dir and disk_mb go together (the disk tier's place and size)")
        if self.kv_store_disk_admission not in STORE_ADMISSIONS:
            raise ValueError(
                f"kv_store disk_admission must be one of {', '.join(STORE_ADMISSIONS)}, "
                f"got {self.kv_store_disk_admission!r}"
            )

    @property
    def kv_store(self) -> bool:
        """Whether this worker uses the host KV store (it needs prefix caching)."""
        return self.prefix_caching and bool(self.kv_store_ram_mb or self.kv_store_disk_mb)

    def to_json(self) -> str:
        """Every field, as the one JSON object ``worker_config_from_json`` reads back."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, separators=(",", ":"))

    def kv_blocks(self, kv_bytes_per_token: int, weight_bytes: int = 0) -> int:
        """The KV blocks this worker allocates for a model whose tokens take ``kv_bytes_per_token``:
        ``num_blocks`` if set, else as many as ``kv_memory_mb`` holds, else as many as ``memory_mb``
        holds beside ``weight_bytes`` of weights, else (auto) room for ``max_running`` sequences of
        ``AUTO_KV_TOKENS`` tokens and never less than ``AUTO_KV_MIN_MB`` (the worker and the
        simulator both use this)."""
        if self.num_blocks:
            return self.num_blocks
        block = kv_bytes_per_token * self.block_size
        if self.kv_memory_mb:
            budget = self.kv_memory_mb * 2**20
        elif self.memory_mb:
            budget = self.memory_mb * 2**20 - weight_bytes
            if budget < block:
                raise ValueError(
                    f"memory_mb = {self.memory_mb} leaves no KV block beside {weight_bytes / 2**20:.0f} MiB "
                    "of weights"
                )
        else:
            budget = max(AUTO_KV_MIN_MB * 2**20, self.max_running * AUTO_KV_TOKENS * kv_bytes_per_token)
        if budget < block:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {block} bytes")
        return budget // block


WORKER_KEYS = frozenset(f.name for f in fields(WorkerConfig)) - _PER_PROCESS  # [worker] table keys
# The Python types a WorkerConfig field accepts, by its annotation (bool is refused where int is asked).
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "str | None": (str, type(None)), "bool": (bool,),
}  # fmt: skip


def worker_default(name: str) -> Any:
    """A ``WorkerConfig`` field's default: what flag help texts quote, so it is written once."""
    f = next(f for f in fields(WorkerConfig) if f.name == name)
    if f.default is MISSING:
        raise ValueError(f"WorkerConfig.{name} has no default")
    return f.default


def worker_config(
    table: Mapping[str, Any], base: WorkerConfig, allowed: frozenset[str], where: str
) -> WorkerConfig:
    """``base`` with the settings in ``table``: the one loader for a deployment's ``[worker]`` and
    ``[[workers]]`` tables and for the serialized config a worker process receives. A key outside
    ``allowed`` or a value of the wrong type is a ``ValueError`` naming it (``where`` says where);
    the values themselves are checked by ``WorkerConfig.__post_init__``."""
    bad = set(table) - allowed
    if bad:
        raise ValueError(f"unknown key(s) in {where}: {', '.join(sorted(bad))}")
    annotations = {f.name: str(f.type) for f in fields(WorkerConfig)}
    for key, value in table.items():
        types = _TYPES[annotations[key]]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"{where}: {key} must be {want}, got {value!r}")
    return replace(base, **table)


def worker_config_from_json(text: str) -> WorkerConfig:
    """The ``WorkerConfig`` that ``WorkerConfig.to_json`` wrote, through the deployment's loader; every
    field must be present, so that the sending and the receiving side never fill in a default each."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"worker config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("worker config must be a JSON object")
    every = frozenset(f.name for f in fields(WorkerConfig))
    missing = every - set(data)
    if missing:
        raise ValueError(f"worker config lacks {', '.join(sorted(missing))}")
    if not isinstance(data["kind"], str):
        raise ValueError(f"worker config: kind must be str, got {data['kind']!r}")
    return worker_config(data, WorkerConfig(kind=data["kind"]), every, "worker config")
