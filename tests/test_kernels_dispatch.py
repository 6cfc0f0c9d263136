"""Backend choice of the kernel seam, and of the linear-layer seam; runs without Triton."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from pdfabric.kernels import dispatch, gather_blocks, paged_attention, scatter_blocks, store_kv
from pdfabric.kernels.attention_ref import paged_attention_ref
from pdfabric.kernels.linear import can_pack, check_kind
from pdfabric.kernels.testing import make_batch


@pytest.fixture
def backend() -> Iterator[Callable[[str], None]]:
    saved = dispatch.get_backend()
    yield dispatch.set_backend
    dispatch.set_backend(saved)


def test_auto_never_touches_triton_on_cpu(
    backend: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend("auto")
    monkeypatch.delitem(sys.modules, "pdfabric.kernels.paged_attention_triton", raising=False)
    q, kv, meta = make_batch(
        [3, 1], [10, 20], q_heads=4, kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    # The CPU attention (or, without a C compiler, the reference itself) serves.
    torch.testing.assert_close(paged_attention(q, kv, meta, 0.25), paged_attention_ref(q, kv, meta, 0.25))
    ids = torch.tensor([2, 0])
    packed = gather_blocks(kv, ids)
    scatter_blocks(kv, ids, packed)
    store_kv(q[:, :2], q[:, 2:], kv, meta.slot_mapping)
    assert "pdfabric.kernels.paged_attention_triton" not in sys.modules  # Triton never touched


def test_torch_backend_never_uses_triton(backend: Callable[[str], None]) -> None:
    backend("torch")
    assert not dispatch.runs_triton(torch.zeros(1))


def test_unknown_backend_is_rejected(backend: Callable[[str], None]) -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        backend("cuda")


def test_linear_kinds_are_checked_against_the_device() -> None:
    for kind, device in (("invariant", "cpu"), ("onednn", "cpu"), ("invariant", "cuda"), ("cublas", "cuda")):
        check_kind(kind, device)
    with pytest.raises(ValueError, match="'cublas' does not run on cpu"):
        can_pack(nn.Linear(4, 4), "cublas")
    with pytest.raises(ValueError, match="'onednn' does not run on cuda; there: invariant, cublas"):
        check_kind("onednn", "cuda")
    with pytest.raises(ValueError, match="unknown linear kernel 'mkl'"):
        check_kind("mkl", "cpu")
    assert not can_pack(nn.Linear(4, 4, device="meta"))  # a device without kernels keeps nn.Linear
