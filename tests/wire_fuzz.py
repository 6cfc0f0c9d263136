"""Frames for fuzzing a socket that speaks ``pdfabric.wire`` (the control socket, the KV endpoints):
random bytes, random msgpack under every registered tag, and valid messages with one field changed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
from hypothesis import strategies as st

from pdfabric.wire import _BY_TAG, encode

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=16,
)  # fmt: skip

KINDS = ("bytes", "tagged", "mutated")


@st.composite
def frames(draw: st.DrawFn, bases: Sequence[Any], kinds: Sequence[str] = KINDS) -> bytes:
    """One encoded frame of a kind drawn from ``kinds``: ``bytes`` (random), ``tagged`` (random fields
    under a registered tag), ``mutated`` (one of ``bases`` with one field replaced), ``valid`` (one of
    ``bases`` as it is)."""
    kind = draw(st.sampled_from(list(kinds)))
    if kind == "bytes":
        return draw(st.binary(max_size=256))
    if kind == "tagged":
        tag = draw(st.sampled_from(sorted(_BY_TAG)))
        return msgpack.packb([tag, *draw(st.lists(values, max_size=16))], use_bin_type=True)
    fields = list(msgpack.unpackb(encode(draw(st.sampled_from(list(bases)))), raw=False))
    if kind == "mutated":
        at = draw(st.integers(1, len(fields) - 1))
        fields[at] = draw(values)
    return msgpack.packb(fields, use_bin_type=True)
