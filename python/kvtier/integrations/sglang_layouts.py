"""SGLang's HiCache host pool as a kvtier layout: what each dimension of the pool's
``kv_buffer`` means (:data:`POOL_DIMS`, by SGLang's layout name), the pool split into pages
(:func:`page_view`), and the staging region KVTierStorage copies pages through
(:class:`StagingLayout`), described with :class:`~kvtier.KvStrides` taken from a tensor's
strides, as :mod:`.kv_layouts` does for vLLM's layer tensors.

SGLang allocates the pool (``mem_cache/pool_host``, read at the commits named in
:mod:`._sglang_standin`):

=================== =========================================== ================================
layout              MHA ``kv_buffer``                           MLA ``kv_buffer``
=================== =========================================== ================================
layer_first         ``(2, layers, size, heads, head_dim)``      ``(layers, size, 1, latent)``
page_first          ``(2, size, layers, heads, head_dim)``      ``(size, layers, 1, latent)``
page_first_direct   ``(2, pages, layers, page, heads, dim)``    ``(pages, layers, page, 1, latent)``
page_head           ``(2, pages, heads, page, layers, dim)``    (none)
=================== =========================================== ================================

``size`` is the pool's token slots (``pages * page_size``); a page is ``page_size``
consecutive slots. One page, flattened in the pool's own order with the page dimension taken
out, is what SGLang's ``get_data_page(index, flat=True)`` returns: the staging region holds
exactly that per block (the page dimension outermost), so a batch of pages moves with one
``index_select`` into the staging region and one ``index_copy_`` back, and its blocks are the
flat pages SGLang's non-zero-copy ``batch_get`` / ``batch_set`` exchange.

Why a staging region rather than the pool itself: the server copies from and to a memfd
region it maps; SGLang allocates the pool with ``torch.empty(..., pin_memory=True)`` and
derives views and raw pointers from it when it is built (``k_buffer``, ``data_refs``,
``k_data_ptrs``), so moving its storage into a region afterwards (``Tensor.set_``, as the vLLM
adapter does with a layer tensor) would leave those pointing at the old memory. The cost of
the extra copy is measured by bench/sglang_hicache.py (docs/performance.md, "SGLang").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

from .._kvtier import AttentionKind, KvLayoutKind, KvRegion, KvStrides, ModelShape, PagedKvLayout
from ..views import dtype_kind_of
from .kv_layouts import BLOCKS, DIM, HEADS, KV, LATENT, TOKENS

__all__ = ["LAYERS", "SLOTS", "POOL_DIMS", "LAYOUTS", "PoolPages", "StagingLayout", "page_view", "pool_kind"]

LAYERS = "layers"  #: the pool's layers (interleaved with the pages in the page-first layouts)
SLOTS = "slots"  #: the pool's token slots: pages x page_size, split by page_view

#: The roles of ``kv_buffer``'s dimensions, by (``"mha"`` or ``"mla"``, SGLang's layout name).
#: MLA's size-1 dimension is the (single) head.
POOL_DIMS: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("mha", "layer_first"): (KV, LAYERS, SLOTS, HEADS, DIM),
    ("mha", "page_first"): (KV, SLOTS, LAYERS, HEADS, DIM),
    ("mha", "page_first_direct"): (KV, BLOCKS, LAYERS, TOKENS, HEADS, DIM),
    ("mha", "page_head"): (KV, BLOCKS, HEADS, TOKENS, LAYERS, DIM),
    ("mla", "layer_first"): (LAYERS, SLOTS, HEADS, LATENT),
    ("mla", "page_first"): (SLOTS, LAYERS, HEADS, LATENT),
    ("mla", "page_first_direct"): (BLOCKS, LAYERS, TOKENS, HEADS, LATENT),
}

#: SGLang's layout names kvtier serves.
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def pool_kind(pool: Any, is_mla: bool) -> Tuple[str, str]:
    """(``"mha"`` or ``"mla"``, layout name) of SGLang's host pool ``pool``; ValueError for a
    layout kvtier does not know (Ascend's ``page_first_kv_split`` keeps K and V in two
    buffers)."""
    layout = str(getattr(pool, "layout", "layer_first"))
    key = ("mla" if is_mla else "mha", layout)
    if key not in POOL_DIMS:
        raise ValueError(
            f"kvtier: SGLang's host pool layout '{layout}' ({key[0].upper()}) is not one kvtier serves: use "
            + ", ".join(name for kind, name in POOL_DIMS if kind == key[0])
        )
    return key


@dataclass(frozen=True)
class PoolPages:
    """The pool as pages: ``tensor`` is ``kv_buffer`` viewed with :data:`SLOTS` split into
    (:data:`BLOCKS`, :data:`TOKENS`), ``dims`` its roles, ``page_dim`` where the pages are."""

    tensor: Any
    dims: Tuple[str, ...]
    page_size: int

    @property
    def page_dim(self) -> int:
        return self.dims.index(BLOCKS)

    @property
    def num_pages(self) -> int:
        return int(self.tensor.shape[self.page_dim])

    def size(self, role: str) -> int:
        return int(self.tensor.shape[self.dims.index(role)]) if role in self.dims else 1

    def page_shape(self) -> Tuple[int, ...]:
        """One page's shape: the other dimensions, in the pool's order."""
        return tuple(int(n) for i, n in enumerate(self.tensor.shape) if i != self.page_dim)

    @property
    def page_bytes(self) -> int:
        """The bytes of one page (SGLang's flat page)."""
        n = self.tensor.element_size()
        for x in self.page_shape():
            n *= x
        return n


def page_view(kv_buffer: Any, dims: Tuple[str, ...], page_size: int) -> PoolPages:
    """``kv_buffer`` (dims ``dims``, :data:`POOL_DIMS`) with its token slots split into pages
    of ``page_size``; no copy. ValueError when the slots are not whole pages."""
    shape, stride = list(kv_buffer.shape), list(kv_buffer.stride())
    if len(shape) != len(dims):
        raise ValueError(
            f"kvtier: SGLang's host pool kv_buffer has shape {tuple(shape)}, not the {len(dims)} dimensions "
            f"{dims} of its layout"
        )
    if SLOTS in dims:
        i = dims.index(SLOTS)
        if page_size <= 0 or shape[i] % page_size:
            raise ValueError(f"kvtier: the host pool's {shape[i]} token slots are not whole pages of {page_size}")
        shape[i : i + 1] = [shape[i] // page_size, page_size]
        stride[i : i + 1] = [stride[i] * page_size, stride[i]]
        dims = dims[:i] + (BLOCKS, TOKENS) + dims[i + 1 :]
        kv_buffer = kv_buffer.as_strided(shape, stride, kv_buffer.storage_offset())
    elif kv_buffer.shape[dims.index(TOKENS)] != page_size:
        raise ValueError(
            f"kvtier: the host pool's pages hold {kv_buffer.shape[dims.index(TOKENS)]} tokens, SGLang's page_size "
            f"is {page_size}"
        )
    return PoolPages(kv_buffer, tuple(dims), page_size)


@dataclass(frozen=True)
class StagingLayout:
    """The staging region for pages of ``pages``' pool: ``num_blocks`` blocks, each one page
    in the pool's own order (SGLang's flat page), contiguous.

    ``layout``: the kvtier :class:`~kvtier.PagedKvLayout` (one page per block, ``page_size``
    tokens per block), its strides read from the staging tensor's; ``shape`` / ``stride``:
    the staging tensor (blocks first), in elements."""

    layout: PagedKvLayout
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dims: Tuple[str, ...]

    @staticmethod
    def of(pages: PoolPages, num_blocks: int) -> "StagingLayout":
        t = pages.tensor
        dims = (BLOCKS,) + tuple(d for d in pages.dims if d != BLOCKS)
        shape = (int(num_blocks),) + pages.page_shape()
        stride = [0] * len(shape)
        step = 1
        for i in range(len(shape) - 1, -1, -1):  # contiguous
            stride[i] = step
            step *= shape[i]
        e = t.element_size()
        st = {role: stride[i] * e for i, role in enumerate(dims)}
        mla = LATENT in dims
        heads = pages.size(HEADS)
        head_dim = pages.size(LATENT if mla else DIM)
        model = ModelShape(
            pages.size(LAYERS), heads, head_dim, dtype_kind_of(t.dtype), AttentionKind.MLA if mla else AttentionKind.MHA
        )
        strides = KvStrides(st[LAYERS], st.get(KV, 0), st[BLOCKS], st[TOKENS], st[HEADS] if heads > 1 else 0)
        # NHD unless a page holds its heads outside its tokens (page_head).
        order = KvLayoutKind.HND if heads > 1 and st[HEADS] > st[TOKENS] else KvLayoutKind.NHD
        layout = PagedKvLayout(model, pages.page_size, int(num_blocks), order, strides)
        problem = layout.validation_error()
        if problem:
            raise ValueError(f"kvtier: cannot stage SGLang's host pool pages {pages.page_shape()} ({dims}): {problem}")
        return StagingLayout(layout, shape, tuple(stride), dims)

    @property
    def kind(self) -> KvLayoutKind:
        """The layout kind chunk objects are written in (part of the model id)."""
        return KvLayoutKind.MLA if self.layout.model.attention == AttentionKind.MLA else self.layout.order

    @property
    def page_bytes(self) -> int:
        return int(self.stride[0]) * self.layout.model.dtype_bytes

    def tensor(self, region: KvRegion, dtype: Any) -> Any:
        """The staging region as a torch tensor of :attr:`shape` (no copy; keeps it alive)."""
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(region.data(), dtype=dtype)
        n = 1
        for x in self.shape:
            n *= x
        return flat[:n].view(self.shape)
