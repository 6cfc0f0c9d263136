"""A worker's end of the KV channel as its core and loop see it: the commands a core returns for it
(``PushKV``, ``OpenPush``, ``ExpectKV``, ``CancelKV``; in process, never on the wire) and the
``KVSide`` the loop drives (the prefill kind's sender, the decode kind's receiver)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq

from pdfabric.engine.sequence import TopLogprobs
from pdfabric.kvtransfer.messages import Meta
from pdfabric.kvtransfer.state import TransferResult


@dataclass(frozen=True)
class PushKV:
    """Prefill side: ship ``local_blocks`` into ``remote_blocks`` at ``endpoint``, the first token
    riding along."""

    request_id: str
    endpoint: str
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    first_token: int
    first_logprob: float
    first_top: TopLogprobs = ()  # its top log-probabilities, when the request asked for them


def kv_meta(push: PushKV) -> Meta:
    """What rides along with a push's KV: the first token, its logprob and top log-probabilities."""
    return {"first_token": push.first_token, "first_logprob": push.first_logprob, "first_top": push.first_top}


def first_token_of(meta: Meta) -> tuple[int, float, TopLogprobs]:
    """The decode side's reading of ``kv_meta``."""
    top = meta.get("first_top", ())
    pairs = tuple((int(t), float(lp)) for t, lp in top) if isinstance(top, (tuple, list)) else ()
    return int(meta.get("first_token", -1)), float(meta.get("first_logprob", 0.0)), pairs


@dataclass(frozen=True)
class OpenPush:
    """Prefill side, before a step that finishes the prompt: start the transfer so that its layers can
    leave as the step computes them (``PushKV`` after the step sends the rest with the first token)."""

    request_id: str
    endpoint: str
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]


@dataclass(frozen=True)
class ExpectKV:
    """Decode side: accept a request's KV into ``blocks`` (reserved by the scheduler)."""

    request_id: str
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class CancelKV:
    """Either side: end the request's transfer; the decode side then reports ``kv_released``."""

    request_id: str
    reason: str


KVCommand = PushKV | ExpectKV | CancelKV


class KVSide(Protocol):
    """A worker's end of the KV channel, driven by the loop (the prefill sender, the decode receiver)."""

    endpoint: str  # where prefill workers push to (decode); "" otherwise

    def sockets(self) -> list[zmq.Socket]: ...  # whose messages should wake the loop

    def command(self, cmd: KVCommand) -> None: ...

    def layer_hook(self, opens: tuple[OpenPush, ...]) -> Callable[[int], None] | None: ...  # per layer

    def poll(self) -> tuple[list[TransferResult], list[str]]: ...  # ended transfers, released requests

    def refused_peers(self) -> int: ...  # handshakes its endpoint refused (peers without the secret)

    def close(self) -> None: ...
