"""Attention, KV-block and element-wise layer kernels behind one seam.

Callers use the functions exported here; which implementation runs is chosen per call from the
tensors' device (Triton kernels on CUDA where available, C kernels on the CPU where they build, the
torch references elsewhere) and can be forced with ``PDFABRIC_KERNEL_BACKEND`` (``auto``, ``torch``,
``cpu``, ``triton``) or ``set_backend``.
"""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level kernels/ folder in the source tree

from pdfabric.kernels.dispatch import (  # noqa: E402 - found through the __path__ just set
    apply_rope,
    gather_blocks,
    get_backend,
    paged_attention,
    rms_norm,
    scatter_blocks,
    set_backend,
    silu_and_mul,
    store_kv,
)
from pdfabric.kernels.metadata import AttentionMetadata  # noqa: E402

__all__ = [
    "AttentionMetadata",
    "apply_rope",
    "gather_blocks",
    "get_backend",
    "paged_attention",
    "rms_norm",
    "scatter_blocks",
    "set_backend",
    "silu_and_mul",
    "store_kv",
]
