"""A serve config and measured profiles turned into the simulator's deployment (``SimConfig``).

Each worker the launcher would start (``ServeConfig.launch_plan``: the default pool's workers, then
each ``[[workers]]`` group's) becomes one ``SimWorker`` with:

- the profile ``profile_file.for_kind`` picks for its kind (a role-tagged one, else one for any kind);
- its own ``[worker]`` / ``[[workers]]`` limits, pool and heartbeat period;
- as many KV blocks as the real worker allocates (``WorkerConfig.kv_blocks`` with the profile's
  ``kv_bytes_per_token`` and, for ``memory_mb``, its ``weight_bytes``);
- the real worker's context limit: the lower of the profile's ``max_model_len`` and what the blocks hold;
- the profile's measured KV rate over ``transport`` (the fastest measured one when ``None``; the
  predictor's ``default_kv_bytes_per_s`` when the profile measured none at all);
- speculation as its config sets it, with a modelled acceptance (``SimWorker``).

The config's ``[routing]`` table gives the router's budgets, classes, pools, policy and predictor.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdfabric.bench.sim_spec import SimWorker
from pdfabric.bench.simulator import SimConfig
from pdfabric.config import ServeConfig
from pdfabric.profile_file import ProfileFile, for_kind
from pdfabric.worker.spec import CoreSpec


def sim_config(
    serve: ServeConfig,
    profiles: Sequence[ProfileFile],
    transport: str | None = None,
    acceptance: float = 0.0,
    draft_ratio: float = 0.0,
) -> SimConfig:
    """One SimWorker per worker the launcher would start for ``serve``; raises ``ValueError`` when a
    kind has no profile, the KV budget holds no block, or ``transport`` was not measured. Workers
    whose config speculates keep proposed tokens with probability ``acceptance`` (0: they run
    without speculation), a draft step costing ``draft_ratio`` decode steps (``SimWorker``)."""
    profiles = list(profiles)
    workers = []
    for worker_id, w in serve.launch_plan():
        pf = for_kind(profiles, w.kind)
        rate = pf.kv_rate(transport) if pf.kv_bytes_per_s else serve.predictor.default_kv_bytes_per_s
        core = CoreSpec.sized(
            w, worker_id=worker_id, model_max_len=pf.max_model_len, kv_bytes_per_token=pf.kv_bytes_per_token,
            weight_bytes=pf.weight_bytes,
        )  # fmt: skip
        workers.append(SimWorker(core, pf.profile, rate, acceptance, draft_ratio))
    return SimConfig(tuple(workers), serve.routing, serve.predictor)


FABRIC_TRANSPORT = "shm"  # what the workers use on one host (kv_transport "auto"; zmq-tcp across hosts)


def default_transport(profiles: Sequence[ProfileFile]) -> str | None:
    """The fabric's own transport when every profile that measured rates measured it, else None (each
    profile's fastest measured rate)."""
    measured = [p.kv_bytes_per_s for p in profiles if p.kv_bytes_per_s]
    return FABRIC_TRANSPORT if measured and all(FABRIC_TRANSPORT in m for m in measured) else None
