"""How an engine's layer tensors are laid out: what each tensor says (shape, strides,
element size) together with what the engine says it allocated (the meaning of each
dimension), turned into a kvtier :class:`~kvtier.PagedKvLayout` with explicit
:class:`~kvtier.KvStrides`.

The meaning of the dimensions comes from vLLM's attention backend when vLLM is importable:
``get_kv_cache_shape`` is called with distinct sentinel sizes and each dimension is named
by the sentinel that lands there (:func:`backend_dims`). Otherwise, and for backends the
sentinels cannot read, from :data:`BACKENDS`, the table of the backends at the pinned vLLM
commit (docs/integration.md, "vLLM": the attention backends), chosen by the
``kv_cache_backend`` option, else by the tensors' device (CPU tensors: ``CPU_ATTN``; 4-D
tensors on a GPU: FlashAttention's), else from the rank as before (:func:`detect_layer_layout`:
``(2, blocks, ., ., head_dim)`` or MLA's ``(blocks, block_size, latent)``).

Dimension roles (:data:`BLOCKS`, :data:`TOKENS`, :data:`HEADS`, :data:`KV`, :data:`DIM`,
:data:`KV_DIM`, :data:`LATENT`). :data:`KV_DIM` is K and V packed in the last dimension
(``2 * head_dim``), which vLLM's backends fill in two different ways:

* ``"row"`` (FlashAttention, FlashInfer, Triton, ROCm): per token and head, ``[..., :D]`` is
  K and ``[..., D:]`` V (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``);
* ``"block_head"`` (``CPU_ATTN``): the kernels view the layer as ``(blocks, heads,
  2 * block_size, head_dim)`` and split it in two along the tokens, so for each (block,
  head) the first ``block_size * head_dim`` elements are K for every token and the next V:
  memory ``(blocks, heads, 2, block_size, head_dim)``, although the shape reads ``(blocks,
  heads, block_size, 2 * head_dim)``. Reading that last dimension as K|V per token would
  store wrong KV.

Kernel blocks: a backend may use blocks smaller than the scheduler's (``kernel_block_size``);
the tensors are then in kernel blocks, and one scheduler block is ``block_size //
kernel_block_size`` consecutive kernel blocks. kvtier describes a scheduler block with one
block stride when those kernel blocks follow one another in the token dimension (the block
stride of the tensor is ``kernel_block_size`` token strides: NHD-ordered and MLA layouts);
otherwise (HND with several heads, the CPU layout) the tokens of a scheduler block do not
lie at one stride and the registration is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from .._kvtier import AttentionKind, KvLayoutKind, KvStrides

__all__ = [
    "BACKENDS",
    "BLOCKS",
    "DIM",
    "HEADS",
    "KV",
    "KV_DIM",
    "LATENT",
    "TOKENS",
    "BackendDims",
    "LayerLayout",
    "backend_dims",
    "backend_of_layers",
    "describe_layer",
    "detect_layer_layout",
    "dims_for",
    "legacy_dims",
]

#: Roles of a tensor dimension.
BLOCKS = "blocks"  #: the (kernel) blocks
TOKENS = "tokens"  #: the tokens of a block
HEADS = "heads"  #: the KV heads
KV = "kv"  #: K then V (size 2)
DIM = "head_dim"  #: a head's elements
KV_DIM = "kv_head_dim"  #: K and V packed (size 2 * head_dim; see the module docstring)
LATENT = "latent"  #: MLA's latent (one per token)


@dataclass(frozen=True)
class BackendDims:
    """What an attention backend's ``get_kv_cache_shape`` returns, dimension by dimension.

    ``dims``: the role of each dimension of the logical shape, in order. ``packing``: how a
    :data:`KV_DIM` dimension holds K and V (``"row"`` or ``"block_head"``). ``source``: where
    this came from (for messages)."""

    name: str
    dims: Tuple[str, ...]
    packing: str = "row"
    source: str = "kvtier's table of the backends at the pinned vLLM commit"

    @property
    def mla(self) -> bool:
        return LATENT in self.dims


_PACKED = (BLOCKS, HEADS, TOKENS, KV_DIM)
_KV_FIRST = (KV, BLOCKS, TOKENS, HEADS, DIM)
_MLA = (BLOCKS, TOKENS, LATENT)


def _table() -> Dict[str, BackendDims]:
    t: Dict[str, BackendDims] = {}
    # K|V packed per token and head: (num_blocks, heads, block_size, 2 * head_size), NHD
    # stride order (0, 2, 1, 3) or HND (0, 1, 2, 3).
    for name in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "ROCM_ATTN", "ROCM_AITER_FA"):
        t[name] = BackendDims(name, _PACKED, "row")
    # vLLM's test backends with the packed shape (tests/v1/...: _Backend, _TestAttentionBackend).
    t["PACKED"] = BackendDims("PACKED", _PACKED, "row")
    # The CPU backend: the same shape, memory (num_blocks, heads, 2, block_size, head_size).
    t["CPU_ATTN"] = BackendDims("CPU_ATTN", _PACKED, "block_head")
    # Not found in a packed-generation version: the older (2, num_blocks, block_size, heads,
    # head_size) (unverified at the pin; the tensors' strides are checked either way).
    for name in ("FLEX_ATTENTION", "TREE_ATTN"):
        t[name] = BackendDims(name, _KV_FIRST, source="an older vLLM version (unverified at the pinned commit)")
    # The generations before the packed one, by layout: K/V first (FlashAttention, Flex,
    # Tree, ROCm) and FlashInfer's blocks first.
    t["KV_FIRST"] = BackendDims("KV_FIRST", _KV_FIRST, source="vLLM's pre-packed backends")
    t["BLOCKS_FIRST"] = BackendDims(
        "BLOCKS_FIRST", (BLOCKS, KV, TOKENS, HEADS, DIM), source="vLLM's intermediate backends (FlashInfer)"
    )
    # MLA: (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim).
    for name in (
        "FLASHMLA",
        "FLASHMLA_SPARSE",
        "CUTLASS_MLA",
        "TRITON_MLA",
        "FLASH_ATTN_MLA",
        "FLASHINFER_MLA",
        "ROCM_AITER_MLA",
    ):
        t[name] = BackendDims(name, _MLA)
    return t


#: The attention backends kvtier knows without vLLM, by vLLM's name (``get_name()``), plus
#: ``PACKED``, ``KV_FIRST`` and ``BLOCKS_FIRST`` for layouts rather than backends.
BACKENDS: Dict[str, BackendDims] = _table()


@dataclass(frozen=True)
class LayerLayout:
    """What kvtier makes of one layer tensor.

    ``strides`` are in bytes with ``layer`` 0 (the region places the layers); ``num_blocks``
    and ``block_size`` are the scheduler's (kernel blocks folded in); ``extent_bytes``: from
    the tensor's first element to the end of its last row; ``shape`` / ``stride``: the
    tensor's own, in elements."""

    kind: KvLayoutKind
    attention: AttentionKind
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    strides: KvStrides
    extent_bytes: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    backend: str


def _name_of(backend: Any) -> str:
    if isinstance(backend, str):
        return backend.upper()
    get_name = getattr(backend, "get_name", None)
    if callable(get_name):
        try:
            return str(get_name()).upper()
        except Exception:  # noqa: BLE001 - a backend we cannot ask: named by its class
            pass
    return str(getattr(backend, "__name__", type(backend).__name__)).upper()


#: Sentinel sizes for get_kv_cache_shape: distinct from each other, from 2 and from twice
#: the head size; the block size a multiple of 16 (FlashAttention's requirement).
_SENTINEL = {"num_blocks": 1009, "block_size": 48, "num_kv_heads": 7, "head_size": 40}


def backend_dims(backend: Any, cache_dtype: str = "auto") -> Optional[BackendDims]:
    """The dimension roles of ``backend``'s KV tensor: ``backend`` is a vLLM attention backend
    class (its ``get_kv_cache_shape`` called with :data:`_SENTINEL` sizes; each dimension is
    named by the sentinel found there) or a name from :data:`BACKENDS`. None when neither
    tells (an unknown name, a shape the sentinels cannot read)."""
    if backend is None:
        return None
    name = _name_of(backend)
    if not isinstance(backend, str) and callable(getattr(backend, "get_kv_cache_shape", None)):
        s = _SENTINEL
        try:
            shape = tuple(
                int(x)
                for x in backend.get_kv_cache_shape(
                    s["num_blocks"], s["block_size"], s["num_kv_heads"], s["head_size"], cache_dtype_str=cache_dtype
                )
            )
        except Exception:  # noqa: BLE001 - a backend that refuses the sentinels: the table decides
            shape = ()
        roles = {s["num_blocks"]: BLOCKS, s["block_size"]: TOKENS, s["num_kv_heads"]: HEADS, 2: KV}
        roles[s["head_size"]] = DIM
        roles[2 * s["head_size"]] = KV_DIM
        dims = tuple(roles.get(x, "?") for x in shape)
        if shape and "?" not in dims and len(set(dims)) == len(dims):
            if HEADS not in dims and KV not in dims and KV_DIM not in dims:  # MLA: one latent per token
                dims = tuple(LATENT if d == DIM else d for d in dims)
            packing = "block_head" if name == "CPU_ATTN" else "row"
            return BackendDims(name, dims, packing, source=f"vLLM's {name}.get_kv_cache_shape")
    return BACKENDS.get(name)


def dims_for(
    ndim: int, device_type: str, backend: Any = None, option: str = "auto", cache_dtype: str = "auto"
) -> Optional[BackendDims]:
    """The roles of a layer tensor's ``ndim`` dimensions: the ``kv_cache_backend`` option
    (``option``, a :data:`BACKENDS` name) when set, else vLLM's ``backend``, else by the
    device: a 4-D tensor is the packed shape, K|V per row on a GPU and ``CPU_ATTN``'s on the
    CPU. None: guess from the rank (:func:`detect_layer_layout`)."""
    if option and option.lower() != "auto":
        found = BACKENDS.get(option.upper())
        if found is None:
            raise ValueError(
                f"kvtier: kv_cache_backend '{option}' is not one kvtier knows: use auto or one of "
                + ", ".join(sorted(BACKENDS))
            )
        return found
    dims = backend_dims(backend, cache_dtype)
    if dims is not None:
        return dims
    if ndim == 4:
        return BACKENDS["CPU_ATTN"] if device_type == "cpu" else BACKENDS["FLASH_ATTN"]
    return None


def backend_of_layers(vllm_config: Any, layer_names: Sequence[str]) -> Any:
    """vLLM's attention backend class of the first of ``layer_names`` (from the compilation
    config's static forward context, where vLLM keeps each attention layer), or None."""
    try:
        ctx = vllm_config.compilation_config.static_forward_context
    except AttributeError:
        return None
    for name in layer_names:
        layer = ctx.get(name) if hasattr(ctx, "get") else None
        if layer is None:
            continue
        get = getattr(layer, "get_attn_backend", None)
        if callable(get):
            try:
                return get()
            except Exception:  # noqa: BLE001 - fall back to the attribute
                pass
        backend = getattr(layer, "attn_backend", None)
        if backend is not None:
            return backend
    return None


def _fail(shape: Sequence[int], stride: Sequence[int], dims: BackendDims, why: str) -> ValueError:
    return ValueError(
        f"kvtier: cannot use a KV layer tensor of shape {tuple(shape)} and strides {tuple(stride)} (elements) as "
        f"{dims.name} {dims.dims} ({dims.source}): {why}"
    )


def describe_layer(
    shape: Sequence[int],
    stride: Sequence[int],
    element_size: int,
    dims: BackendDims,
    block_size: int,
    want: Optional[KvLayoutKind] = None,
) -> LayerLayout:
    """Describes one layer tensor of ``shape`` and ``stride`` (elements of ``element_size``
    bytes) whose dimensions mean ``dims``, for an engine whose scheduler blocks hold
    ``block_size`` tokens. ``want``: the configured order (what the scheduler registers),
    which decides where the strides cannot (one head, one token per block) and must agree
    otherwise. Raises ValueError, naming the shape and strides, for what kvtier cannot
    copy."""
    shape = tuple(int(x) for x in shape)
    stride = tuple(int(x) for x in stride)
    if len(shape) != len(dims.dims):
        raise _fail(
            shape, stride, dims, f"{dims.name} allocates {len(dims.dims)} dimensions, the tensor has {len(shape)}"
        )
    if any(s < 0 for s in stride):
        raise _fail(shape, stride, dims, "negative strides")
    at = {role: i for i, role in enumerate(dims.dims)}
    size = {role: shape[i] for role, i in at.items()}
    st = {role: stride[i] for role, i in at.items()}
    inner = DIM if DIM in at else KV_DIM if KV_DIM in at else LATENT
    if size[inner] > 1 and st[inner] != 1:
        raise _fail(
            shape, stride, dims, f"the {inner} dimension is not contiguous (stride {st[inner]}, kvtier needs 1)"
        )
    heads, head_stride = (size[HEADS], st[HEADS]) if HEADS in at else (1, 0)
    kernel_blocks, kernel_block_size = size[BLOCKS], size[TOKENS]
    token_stride, kernel_block_stride = st[TOKENS], st[BLOCKS]
    if dims.mla:
        attention, head_dim, plane_stride = AttentionKind.MLA, size[LATENT], 0
    elif KV in at:
        if size[KV] != 2:
            raise _fail(shape, stride, dims, f"the K/V dimension has {size[KV]} entries, not 2")
        attention, head_dim, plane_stride = AttentionKind.MHA, size[DIM], st[KV]
    else:
        if size[KV_DIM] % 2:
            raise _fail(shape, stride, dims, f"the packed K|V dimension has an odd size {size[KV_DIM]}")
        attention, head_dim = AttentionKind.MHA, size[KV_DIM] // 2
        if dims.packing == "block_head":
            # (tokens, 2 * head_dim) of one (block, head) is (2, tokens, head_dim).
            if kernel_block_size > 1 and token_stride != size[KV_DIM]:
                raise _fail(
                    shape,
                    stride,
                    dims,
                    f"{dims.name} packs K and V per (block, head) as (2, block_size, head_dim), which needs the "
                    f"tokens and the packed dimension contiguous together (token stride {size[KV_DIM]}, not "
                    f"{token_stride})",
                )
            plane_stride, token_stride = kernel_block_size * head_dim, head_dim
        else:
            plane_stride = head_dim  # [..., :D] is K, [..., D:] is V
    # Kernel blocks smaller than the scheduler's: one block stride only where they follow
    # one another in the token dimension.
    if kernel_block_size <= 0 or block_size % kernel_block_size:
        raise _fail(
            shape, stride, dims, f"the tensors' blocks of {kernel_block_size} tokens do not divide the engine's "
            f"block_size {block_size}"
        )
    per = block_size // kernel_block_size
    if per > 1:
        if kernel_blocks % per:
            raise _fail(
                shape, stride, dims, f"{kernel_blocks} kernel blocks are not whole blocks of {block_size} tokens"
            )
        if kernel_block_stride != kernel_block_size * token_stride:
            raise _fail(
                shape,
                stride,
                dims,
                f"a block of {block_size} tokens is {per} kernel blocks of {kernel_block_size} that do not follow "
                f"one another in the token dimension (block stride {kernel_block_stride}, {kernel_block_size} x "
                f"token stride {token_stride} = {kernel_block_size * token_stride}), so its tokens lie at no one "
                "stride: use a kernel block size equal to the block size, or an NHD stride order",
            )
    num_blocks = kernel_blocks // per
    block_stride = kernel_block_stride * per
    # The order of the chunk objects: the strides' own (HND iff heads are outer), and the
    # configured one where the strides cannot tell.
    if attention == AttentionKind.MLA:
        kind = KvLayoutKind.MLA
    elif heads > 1 and block_size > 1:
        kind = KvLayoutKind.HND if head_stride > token_stride else KvLayoutKind.NHD
        if want is not None and want != KvLayoutKind.MLA and want != kind:
            raise _fail(
                shape,
                stride,
                dims,
                f"the blocks are {kind.name} in memory but kv_layout says {want.name}: the scheduler would name "
                "other chunks; set kv_layout to match the attention backend",
            )
    else:
        kind = want if want in (KvLayoutKind.NHD, KvLayoutKind.HND) else KvLayoutKind.NHD
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    e = int(element_size)
    return LayerLayout(
        kind=kind,
        attention=attention,
        num_kv_heads=heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        strides=KvStrides(0, plane_stride * e, block_stride * e, token_stride * e, head_stride * e),
        extent_bytes=extent * e,
        shape=shape,
        stride=stride,
        backend=dims.name,
    )


def detect_layer_layout(
    shape: Sequence[int], stride: Sequence[int], block_size: int, want: Optional[KvLayoutKind]
) -> Tuple[KvLayoutKind, Tuple[int, ...]]:
    """The physical layout kind of a layer tensor, and the permutation that puts its dims in
    physical order (outermost first): the guess from the rank used when nothing says what
    the dimensions mean.

    A 5-dim MHA tensor has dims (2, num_blocks, a, b, head_dim) where one of a, b is the
    block's tokens (size ``block_size``) and the other the KV heads; which one, and which is
    outer in memory, comes from the sizes and strides (a backend may hand out a permuted view).
    ``want`` (the configured kind) decides when heads == block_size and is checked otherwise.
    A 3-dim tensor is MLA."""
    if len(shape) == 3:
        return KvLayoutKind.MLA, (0, 1, 2)
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(
            f"kvtier: a layer tensor of shape {tuple(shape)} and strides {tuple(stride)} is neither (2, blocks, "
            "tokens|heads, heads|tokens, head_dim) nor MLA's (blocks, tokens, latent), and nothing says what its "
            "dimensions mean: set kv_connector_extra_config['kv_cache_backend'] to the attention backend "
            f"({', '.join(sorted(BACKENDS))})"
        )
    if shape[2] == block_size and shape[3] != block_size:
        token_dim = 2
    elif shape[3] == block_size and shape[2] != block_size:
        token_dim = 3
    elif shape[2] == block_size and shape[3] == block_size:
        if want is None:
            raise ValueError(
                "kvtier: the KV heads equal the block size, so the layout cannot be told from the tensors: "
                "set kv_connector_extra_config['kv_layout'] to NHD or HND"
            )
        token_dim = 2 if want == KvLayoutKind.NHD else 3
    else:
        raise ValueError(f"kvtier: no dim of the layer tensor {tuple(shape)} is the block size {block_size}")
    head_dim_axis = 5 - token_dim  # the other of 2, 3
    if stride[token_dim] >= stride[head_dim_axis]:
        kind, order = KvLayoutKind.NHD, (0, 1, token_dim, head_dim_axis, 4)
    else:
        kind, order = KvLayoutKind.HND, (0, 1, head_dim_axis, token_dim, 4)
    if want is not None and want != KvLayoutKind.MLA and kind != want:
        raise ValueError(
            f"kvtier: the KV tensors are {kind.name} in memory but kv_layout says {want.name}: the scheduler "
            "would name other chunks; set kv_layout to match the attention backend"
        )
    return kind, order


def legacy_dims(
    shape: Sequence[int], stride: Sequence[int], block_size: int, want: Optional[KvLayoutKind]
) -> BackendDims:
    """The roles of a tensor in today's 5-D ``(2, blocks, tokens|heads, heads|tokens, D)`` or
    3-D MLA form (:func:`detect_layer_layout` tells tokens from heads)."""
    kind, order = detect_layer_layout(shape, stride, block_size, want)
    if kind == KvLayoutKind.MLA:
        return BackendDims("MLA", _MLA, source="the tensor's rank (3: MLA)")
    token_dim = order[2] if kind == KvLayoutKind.NHD else order[3]
    dims = [KV, BLOCKS, "", "", DIM]
    dims[token_dim] = TOKENS
    dims[5 - token_dim] = HEADS
    return BackendDims("KV_FIRST", tuple(dims), source="the tensor's rank (5: K/V first)")
