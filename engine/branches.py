"""A request's several outputs (``n`` > 1) as sequences of their own. No torch here.

A request with branches is one sequence until its prompt's KV is complete (computed here, or
arrived); then each branch becomes a sequence of its own that holds a reference to the prompt's full
blocks and computes only its tail (the prompt's last partial block, and a resumed branch's earlier
output) before it samples. The prompt is computed once, and its blocks return to the pool when the
last output that shares them ends. The scheduler queues the branches and ends them with their
request (``Scheduler.finish``).
"""

from __future__ import annotations

from pdfabric.engine.block_pool import BlockTables, cacheable_blocks
from pdfabric.engine.sequence import Sequence, branch_id, branch_params


class Branches:
    """The live sequences of each request with branches, by the request's id."""

    def __init__(self, tables: BlockTables) -> None:
        self.tables = tables
        self._groups: dict[str, set[str]] = {}  # a request with branches -> its live sequences' ids

    def start(self, seq: Sequence) -> list[Sequence]:
        """The branches of ``seq``, whose prompt's KV is complete, as sequences that share its full
        blocks (none when it has no branches left to start); the caller queues them."""
        if not seq.branches:
            return []
        branches, seq.branches = seq.branches, ()
        bs = self.tables.pool.block_size
        table = self.tables.table(seq.request_id)
        prompt = seq.prompt_ids[: len(seq.prompt_ids) - seq.params.output_offset]
        members = self._groups.setdefault(seq.request_id, {seq.request_id})
        started = []
        for b in branches:
            child = Sequence(
                branch_id(seq.request_id, b.choice), prompt + b.output, branch_params(seq, b),
                seq.eos_token_ids, group=seq.request_id,
            )  # fmt: skip
            shared = table[: min(len(prompt) // bs, cacheable_blocks(child.num_tokens, bs))]
            self.tables.pool.share(shared)
            self.tables.attach(child.request_id, shared)
            child.num_cached, child.recorded = len(shared) * bs, min(seq.recorded, len(shared))
            child.prefix_hit = 0  # not a prompt of its own: no prefix cache query
            members.add(child.request_id)
            started.append(child)
        return started

    def others(self, request_id: str) -> list[str]:
        """The ids of the live sequences a request started besides itself, in order."""
        return sorted(self._groups.get(request_id, set()) - {request_id})

    def ended(self, seq: Sequence) -> None:
        """``seq`` (a request, or one of its branches) is done."""
        group = seq.group or seq.request_id
        members = self._groups.get(group)
        if members is not None:
            members.discard(seq.request_id)
            if not members:
                del self._groups[group]
