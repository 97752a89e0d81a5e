"""Typed, zero-copy views of a :class:`kvtier.KvRegion`'s layers.

A region exposes each layer's tensor as a writable byte buffer (:meth:`KvRegion.layer`); the
functions here turn those bytes into torch tensors or numpy arrays of the region's dtype and
of vLLM's per-layer shape, sharing the memory (no copy). Writing into a view writes the
region the server reads; reading a view reads what a retrieve scattered there.

Shapes (:func:`layer_shape`), as vLLM's attention backends lay out one layer:

* NHD: ``(2, num_blocks, block_size, num_kv_heads, head_dim)``
* HND: ``(2, num_blocks, num_kv_heads, block_size, head_dim)``
* MLA: ``(num_blocks, block_size, latent_dim)``

contiguous for a dense region, at the region's :class:`~kvtier.KvStrides` (divided by the
element size: :func:`layer_strides`) for a region with explicit strides. A region created
for an engine's own tensors (:mod:`kvtier.integrations.kv_layouts`) is viewed in the
engine's shape and strides instead: pass them to :func:`torch_layers`.

bf16 (and fp8) have no numpy dtype: :func:`numpy_layers` returns their raw bits
(``uint16``, ``uint8``); torch has ``bfloat16`` (and ``float8_*`` from torch 2.1 on; before,
``uint8``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from ._kvtier import DtypeKind, KvLayoutKind, KvRegion, PagedKvLayout

if TYPE_CHECKING:  # pragma: no cover
    import numpy
    import torch

__all__ = [
    "layer_shape",
    "layer_strides",
    "torch_dtype",
    "dtype_kind_of",
    "torch_layers",
    "numpy_layers",
]


def layer_shape(layout: PagedKvLayout) -> Tuple[int, ...]:
    """The shape of one layer's tensor for ``layout`` (see the module docstring)."""
    m = layout.model
    if layout.kind == KvLayoutKind.MLA:
        return (layout.num_blocks, layout.block_size, m.head_dim)
    if layout.kind == KvLayoutKind.HND:
        return (2, layout.num_blocks, m.num_kv_heads, layout.block_size, m.head_dim)
    return (2, layout.num_blocks, layout.block_size, m.num_kv_heads, m.head_dim)


def layer_strides(layout: PagedKvLayout) -> Tuple[int, ...]:
    """The element strides of :func:`layer_shape` in ``layout`` (its effective byte strides
    divided by the element size: contiguous for a dense layout)."""
    s = layout.effective_strides
    e = layout.model.dtype_bytes
    d = {"plane": s.plane // e, "block": s.block // e, "token": s.token // e, "head": s.head // e}
    if layout.kind == KvLayoutKind.MLA:
        return (d["block"], d["token"], 1)
    if layout.kind == KvLayoutKind.HND:
        return (d["plane"], d["block"], d["head"], d["token"], 1)
    return (d["plane"], d["block"], d["token"], d["head"], 1)


def torch_dtype(kind: DtypeKind) -> "torch.dtype":
    """The torch dtype that holds elements of ``kind`` (fp8 as ``uint8`` before torch 2.1)."""
    import torch

    table = {
        DtypeKind.FP32: torch.float32,
        DtypeKind.FP16: torch.float16,
        DtypeKind.BF16: torch.bfloat16,
        DtypeKind.INT8: torch.int8,
        DtypeKind.FP8_E4M3: getattr(torch, "float8_e4m3fn", torch.uint8),
        DtypeKind.FP8_E5M2: getattr(torch, "float8_e5m2", torch.uint8),
    }
    return table[kind]


def dtype_kind_of(dtype: Any) -> DtypeKind:
    """The kvtier dtype kind of a torch dtype (or of its name: ``"bfloat16"``, ``"fp8_e4m3"``).

    ``torch.uint8`` is ambiguous (vLLM stores fp8 KV caches as uint8): pass the name of the
    fp8 format instead. Raises ValueError for a dtype kvtier has no kind for.
    """
    from ._kvtier import parse_dtype_kind

    if isinstance(dtype, str):
        return parse_dtype_kind(dtype)
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    if name == "uint8":
        raise ValueError(
            "kvtier: a uint8 KV cache is ambiguous: give its fp8 format ('fp8_e4m3' or 'fp8_e5m2')"
        )
    return parse_dtype_kind(name)


def torch_layers(
    region: KvRegion,
    shape: Optional[Sequence[int]] = None,
    stride: Optional[Sequence[int]] = None,
    dtype: Optional["torch.dtype"] = None,
) -> List["torch.Tensor"]:
    """One torch tensor per layer sharing the region's memory; each keeps the region alive.

    By default of the region's dtype, :func:`layer_shape` and :func:`layer_strides`. With
    ``shape`` and ``stride`` (in elements of ``dtype``, by default the region's): each layer
    viewed as that tensor from the layer's base, e.g. the shape and strides an engine
    allocated its layer with, when the region was created with those strides (vLLM's K|V
    packed ``(num_blocks, heads, block_size, 2 * head_dim)`` in its stride order). A view
    that reaches past the layer's rows raises ValueError."""
    import torch
    import warnings

    layout = region.layout
    dtype = dtype if dtype is not None else torch_dtype(layout.model.dtype)
    if shape is None:
        shape, stride = layer_shape(layout), layer_strides(layout)
    elif stride is None:
        raise ValueError("kvtier.torch_layers: give stride with shape")
    shape, stride = tuple(int(x) for x in shape), tuple(int(x) for x in stride)
    if len(shape) != len(stride) or any(x < 0 for x in stride):
        raise ValueError(f"kvtier.torch_layers: shape {shape} and stride {stride} do not describe a tensor")
    itemsize = torch.empty((), dtype=dtype).element_size()
    extent = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    if extent * itemsize > layout.layer_bytes:
        raise ValueError(
            f"kvtier.torch_layers: shape {shape} with stride {stride} reaches {extent * itemsize} bytes, past the "
            f"{layout.layer_bytes} bytes of a layer of the region ({layout.describe()})"
        )
    out = []
    for layer in range(region.num_layers):
        with warnings.catch_warnings():
            # The buffer is writable; torch warns only for read-only buffers, but older
            # versions warn about any buffer that does not come from Python itself.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(region.layer(layer), dtype=dtype)
        out.append(flat.as_strided(shape, stride))
    return out


def numpy_layers(region: KvRegion) -> List["numpy.ndarray"]:
    """One numpy array per layer, of :func:`layer_shape`, sharing the region's memory: float32,
    float16 or int8 elements, and the raw bits (uint16, uint8) of bf16 and fp8."""
    import numpy as np

    layout = region.layout
    kind = layout.model.dtype
    dtype = {
        DtypeKind.FP32: np.float32,
        DtypeKind.FP16: np.float16,
        DtypeKind.BF16: np.uint16,
        DtypeKind.INT8: np.int8,
        DtypeKind.FP8_E4M3: np.uint8,
        DtypeKind.FP8_E5M2: np.uint8,
    }[kind]
    shape = layer_shape(layout)
    item = np.dtype(dtype).itemsize
    strides = tuple(x * item for x in layer_strides(layout))
    return [
        np.lib.stride_tricks.as_strided(np.frombuffer(region.layer(layer), dtype=dtype), shape, strides)
        for layer in range(region.num_layers)
    ]
