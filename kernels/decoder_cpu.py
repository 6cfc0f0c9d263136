"""A decode step's decoder layers in one C call (``csrc/decoder_cpu.c``), for the CPU; also a step of
short chunks, each new token a decode row of its sequence (``AttentionMetadata.token_rows``).

The model runs a layer as about a dozen ops from Python (``engine/model.py``); at SmolLM2's shapes
(30 narrow layers) a batch-1 decode step spent about a third of its time between them. ``Decoder``
runs the same kernels, in the same order with the same arguments, from C: the C driver receives the
kernels' addresses from the libraries the op-by-op path loads, so its results are the same to the bit
and every invariance the kernels give holds on both paths (``tests/test_decoder_cpu.py``).

It serves decode steps (and the steps of short chunks the runner gives it) when every piece of a
layer is a C kernel here: float32 or bfloat16 CPU tensors, batch-invariant linear layers
(``linear_cpu``), the layer ops (``layer_ops_cpu``) and decode rows on the prompt kernel
(``paged_attention_cpu.decodes_as_prefill``). Float32 on a CPU without AVX-512 (decode rows on the
decode kernel, ``csrc/paged_decode_cpu.c``, whose last bits differ from a prompt chunk's) is served
too, but only steps whose every sequence has one new token (``rows_only``): a short chunk there takes
the forward and the prompt kernel, as it does in any batch. ``Decoder.build`` returns None otherwise,
and the model's own forward serves every step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pdfabric.kernels import cpu_build, dispatch, layer_ops_cpu, linear_cpu, paged_attention_cpu, tiled_kv_cpu
from pdfabric.kernels.linear_cpu import InvariantLinear
from pdfabric.kernels.metadata import AttentionMetadata

_p = ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [
        (name, _p)
        for name in ("rms_norm", "linear", "rope", "silu_mul", "store_kv", "store_kv_tiled", "decode_rows")
    ]


_SHAPE_INTS = ("hidden", "heads", "kv_heads", "head_dim", "inter", "block_size", "dtype", "tiled")
_LAYER_PTRS = (
    "input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "down", "k_cache", "v_cache",
)  # fmt: skip
_LINEAR_DTYPES = ("qkv_dtype", "o_dtype", "gate_up_dtype", "down_dtype")  # each linear's pd_linear dtype
_SCRATCH = ("normed", "qkv", "rot", "attn", "proj", "gate_up", "act")


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in _SHAPE_INTS),
        ("num_slots", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _p) for name in _LAYER_PTRS), *((name, ctypes.c_int) for name in _LINEAR_DTYPES)]


class _Step(ctypes.Structure):
    _fields_ = [
        ("x", _p),
        ("rows", ctypes.c_int),
        ("cos", _p),
        ("sin", _p),
        ("slots", _p),
        ("tables", _p),
        ("tables_stride", ctypes.c_int64),
        ("row_token", _p),
        ("row_seq", _p),
        ("ctx_lens", _p),
        *((name, _p) for name in _SCRATCH),
        ("threads", ctypes.c_int),
    ]


def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("decoder_cpu")
    if lib is not None and not hasattr(lib, "_pdfabric_typed"):
        lib.pd_decoder_layers.argtypes = [_p, _p, _p, ctypes.c_int, _p]
        lib.pd_decoder_layers.restype = ctypes.c_int
        lib._pdfabric_typed = True
    return lib


def _linears(layer: torch.nn.Module) -> tuple[InvariantLinear, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Decoder:
    """The decoder layers of one model over its KV caches, run from C for decode steps (and short
    chunks: any step, each token a decode row; the runner says which steps)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], tiled: bool) -> None:
        # Use ``build``, which checks that every piece is a C kernel first.
        cfg = model.config
        self.dtype = dtype = model.model.norm.weight.dtype
        ops = layer_ops_cpu.kernel_addresses()
        int8 = kv_caches[0].dtype == torch.int8  # an int8 cache is tiled, written by pd_store_kv_int8
        # True: decode rows take the decode kernel (their bits are not a prompt chunk's), so this serves
        # steps of one new token a sequence only; the runner gives it no others
        self.rows_only = not (tiled or paged_attention_cpu.decodes_as_prefill(dtype))
        rows = (
            paged_attention_cpu.decode_kernel_rows_address()
            if self.rows_only
            else paged_attention_cpu.decode_rows_address(dtype, tiled, int8)
        )
        self._kernels = _Kernels(
            ops["rms_norm"], linear_cpu.kernel_address(), ops["rope"], ops["silu_mul"], ops["store_kv"],
            tiled_kv_cpu.store_kv_tiled_address(int8) if tiled else None, rows,
        )  # fmt: skip
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        self._shape = _Shape(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            block_size, layer_ops_cpu.DTYPE_CODES[dtype], int(tiled), num_blocks * block_size,
            cfg.rms_norm_eps, cfg.head_dim**-0.5,
        )  # fmt: skip
        self._keep: list[torch.Tensor] = []  # norm weights in the model dtype, alive as long as this is
        layers = []
        for layer, cache in zip(model.model.layers, kv_caches, strict=True):
            qkv, o, gate_up, down = _linears(layer)
            layers.append(_Layer(
                self._norm(layer.input_layernorm.weight), _ptr(qkv.packed_weight), _ptr(qkv.bias),
                _ptr(o.packed_weight), _ptr(o.bias), self._norm(layer.post_attention_layernorm.weight),
                _ptr(gate_up.packed_weight), _ptr(down.packed_weight), _ptr(cache[0]), _ptr(cache[1]),
                qkv.dtype_code, o.dtype_code, gate_up.dtype_code, down.dtype_code,
            ))  # fmt: skip
        self._layers = (_Layer * len(layers))(*layers)
        self._widths = {
            "normed": cfg.hidden_size,
            "qkv": (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
            "rot": (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim,
            "attn": cfg.num_heads * cfg.head_dim,
            "proj": cfg.hidden_size,
            "gate_up": 2 * cfg.intermediate_size,
            "act": cfg.intermediate_size,
        }
        self._scratch: dict[str, torch.Tensor] = {}
        self._run = _library().pd_decoder_layers

    @staticmethod
    def build(model: torch.nn.Module, kv_caches: list[torch.Tensor], tiled: bool = False) -> Decoder | None:
        """A ``Decoder`` for the model over its caches (tiled ones: ``AttentionMetadata.tiled_kv``), or
        None when some piece of its layers is not a C kernel here."""
        weight = model.model.norm.weight
        if (
            dispatch.get_backend() not in ("auto", "cpu")
            or not weight.is_cpu
            or not layer_ops_cpu.supports(weight)
            or _library() is None
            or not (paged_attention_cpu.decodes_as_prefill(weight.dtype) or weight.dtype == torch.float32)
        ):
            return None
        for layer in model.model.layers:  # each linear in a format of its own (quantized or not)
            for m in _linears(layer):
                if not isinstance(m, InvariantLinear) or m._dtype != weight.dtype:
                    return None
        cfg = model.config
        q = torch.empty(1, cfg.num_heads, cfg.head_dim, dtype=weight.dtype)
        for cache in kv_caches:
            if not (
                paged_attention_cpu.supports(q, cache)
                and paged_attention_cpu.prefill_supported(q, cache)
                and (tiled or layer_ops_cpu.can_store_kv(q[:, : cfg.num_kv_heads], cache))
            ):
                return None
        return Decoder(model, kv_caches, tiled)

    def _norm(self, weight: torch.Tensor) -> int:
        w = weight.detach().to(self.dtype).contiguous()
        self._keep.append(w)
        return w.data_ptr()

    def _buffers(self, rows: int) -> dict[str, torch.Tensor]:
        """Scratch for ``rows`` tokens, grown as needed and kept from step to step."""
        if not self._scratch or self._scratch["normed"].shape[0] < rows:
            self._scratch = {k: torch.empty(rows, w, dtype=self.dtype) for k, w in self._widths.items()}
        return self._scratch

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Runs every layer over the residual stream ``x`` ``[T, hidden]`` (contiguous, updated in
        place) of the step ``meta`` describes, every token a decode row attending up to itself (its KV
        written first); ``cos``, ``sin``: ``[T, 1, head_dim]`` float32 as the model's
        forward makes them. ``after_layer(i)``: called as each layer finishes."""
        rows = meta.token_rows
        scratch = self._buffers(x.shape[0])
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
        tables = meta.block_tables
        step = _Step(
            x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
            tables.stride(0), rows.token.data_ptr(), rows.seq.data_ptr(), rows.ctx_len.data_ptr(),
            *(scratch[k].data_ptr() for k in _SCRATCH), torch.get_num_threads(),
        )  # fmt: skip
        layers = ctypes.addressof(self._layers)
        with cpu_build.profiled("decoder_layers_cpu"):
            if after_layer is None:
                status = self._run(ctypes.byref(self._kernels), ctypes.byref(self._shape), layers,
                                   len(self._layers), ctypes.byref(step))  # fmt: skip
            else:
                for i in range(len(self._layers)):
                    status = self._run(ctypes.byref(self._kernels), ctypes.byref(self._shape),
                                       layers + i * ctypes.sizeof(_Layer), 1, ctypes.byref(step))  # fmt: skip
                    if status != 0:
                        break
                    after_layer(i)
        if status != 0:
            raise RuntimeError(f"pd_decoder_layers failed with status {status} (1: bad arguments, 2: memory)")
