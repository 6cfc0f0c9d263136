"""A request's several outputs (``n`` > 1) in the worker cores, with no process or model: the prompt is
computed once, its full blocks are shared by reference count, each output samples as it would alone.

The fake model's token depends on the sequence's tokens and its output's ``choice`` (its seed stream).
"""

from __future__ import annotations

from pdfabric.control import Abort, Generate, Reserve, Reserved, StepOutputs, TokenDelta
from pdfabric.decode.core import ColocatedCore, DecodeCore
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import Branch, SamplingParams
from pdfabric.worker.core import Out, WorkerCore
from pdfabric.worker.kv import ExpectKV
from pdfabric.worker.spec import CoreSpec, FixedProfile
from tests.core_helpers import core_spec

PROFILE = FixedProfile(WorkerProfile())
BS = 4
PROMPT = tuple(range(1, 12))  # 11 tokens: two full blocks and a partial one


def _spec(kind: str, num_blocks: int = 64) -> CoreSpec:
    return core_spec(kind, num_blocks, block_size=BS, max_model_len=128, max_batch_tokens=32)


def _token(history: tuple[int, ...], choice: int) -> int:
    return (sum(history) * 31 + len(history) + 17 * choice) % 97 + 3


class Run:
    """Steps a core with the fake model, counting the prompt tokens it computes."""

    def __init__(self, core: WorkerCore) -> None:
        self.core, self.deltas, self.prefilled = core, [], 0

    def step(self) -> Out:
        step = self.core.schedule()
        if step is None:
            return []
        for c in step.chunks:
            if c.seq.state.value == "waiting":
                self.prefilled += c.stop - c.start
        picks = [
            (_token(c.seq.token_slice(0, c.stop), c.seq.params.choice), -0.5) for c in step.chunks if c.sample
        ]
        out = self.core.complete(step, picks, 0.01)
        self.deltas += [d for m in out if isinstance(m, StepOutputs) for d in m.deltas]
        return out

    def until_idle(self) -> None:
        while self.core.has_work:
            self.step()

    def tokens(self, rid: str, choice: int) -> list[int]:
        mine = sorted(
            (d for d in self.deltas if d.request_id == rid and d.choice == choice), key=lambda d: d.index
        )
        return [t for d in mine for t in d.token_ids]


def _alone(choice: int, params: SamplingParams, prompt: tuple[int, ...] = PROMPT) -> list[int]:
    run = Run(ColocatedCore(_spec("colocated"), PROFILE))
    run.core.handle(Generate("x", prompt, SamplingParams(**{**params.__dict__, "choice": choice}), ()))
    run.until_idle()
    return run.tokens("x", choice)


PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def test_colocated_branches_compute_the_prompt_once_and_sample_as_alone() -> None:
    run = Run(ColocatedCore(_spec("colocated"), PROFILE))
    pool = run.core.tables.pool
    run.core.handle(Generate("r", PROMPT, PARAMS, (), (Branch(1), Branch(2))))
    run.step()  # the whole prompt, and the request's first token
    table = run.core.tables.table("r")
    assert [pool.ref_count(b) for b in table] == [3, 3, 1]  # the full blocks are shared, the tail is not
    run.until_idle()
    for choice in (0, 1, 2):
        assert run.tokens("r", choice) == _alone(choice, PARAMS), choice
    assert len({tuple(run.tokens("r", c)) for c in (0, 1, 2)}) == 3
    # The prompt once, and each branch's tail (the partial block's 3 tokens) once.
    assert run.prefilled == len(PROMPT) + 2 * 3
    assert pool.num_free == pool.num_blocks and len(run.core.scheduler) == 0


def test_decode_core_branches_share_the_blocks_the_kv_arrived_in() -> None:
    core = DecodeCore(_spec("decode"), PROFILE, "tcp://kv")
    out = core.handle(Reserve("r", PROMPT, PARAMS, (), (Branch(1), Branch(2))))
    expect = next(m for m in out if isinstance(m, ExpectKV))
    assert next(m for m in out if isinstance(m, Reserved)).block_ids == expect.blocks
    first = _token(PROMPT, 0)
    meta = {"first_token": first, "first_logprob": -0.5, "first_top": ()}
    core.transfer_ended(TransferResult("r", TransferState.DONE, nbytes=1, seconds=0.1, meta=meta))
    assert [core.tables.pool.ref_count(b) for b in expect.blocks] == [3, 3, 1]
    run = Run(core)
    run.until_idle()
    assert [first, *run.tokens("r", 0)] == _alone(0, PARAMS)
    for choice in (1, 2):
        assert run.tokens("r", choice) == _alone(choice, PARAMS), choice
    assert core.tables.pool.num_free == core.tables.pool.num_blocks


def test_abort_of_a_request_ends_its_branches_even_after_its_own_output_ended() -> None:
    core = ColocatedCore(_spec("colocated"), PROFILE)
    short = SamplingParams(max_tokens=1, ignore_eos=True)
    core.handle(Generate("r", PROMPT, short, (), (Branch(1, ()),)))
    run = Run(core)
    run.step()  # the request's own output is done after one token; its branch waits to run
    assert core.scheduler.get("r") is None and len(core.scheduler) == 1
    core.handle(Abort("r", "client gone"))
    assert len(core.scheduler) == 0 and core.tables.pool.num_free == core.tables.pool.num_blocks


def test_a_resumed_request_continues_each_output_where_it_stopped() -> None:
    full = {c: _alone(c, PARAMS) for c in (0, 1, 2)}
    # Output 0 had 2 tokens out, output 1 had 4, output 2 none: the resumed run gets the rest of each.
    run = Run(ColocatedCore(_spec("colocated"), PROFILE))
    resumed = SamplingParams(max_tokens=4, ignore_eos=True, output_offset=2)
    branches = (Branch(1, tuple(full[1][:4])), Branch(2, ()))
    run.core.handle(Generate("r~1", PROMPT + tuple(full[0][:2]), resumed, (), branches))
    run.until_idle()
    assert run.tokens("r~1", 0) == full[0][2:]
    assert run.tokens("r~1", 1) == full[1][4:]
    assert run.tokens("r~1", 2) == full[2]
    assert run.core.tables.pool.num_free == run.core.tables.pool.num_blocks


def test_branches_that_make_no_sense_are_one_error_delta() -> None:
    core = ColocatedCore(_spec("colocated"), PROFILE)
    for branches in ((Branch(0),), (Branch(1), Branch(1)), (Branch(1, tuple(range(6))),)):
        out = core.handle(Generate("r", PROMPT, PARAMS, (), branches))
        (delta,) = [d for m in out if isinstance(m, StepOutputs) for d in m.deltas]
        assert isinstance(delta, TokenDelta) and delta.finish_reason == "error", branches
    assert len(core.scheduler) == 0
