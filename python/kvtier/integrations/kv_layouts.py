"""How an engine's layer tensors are laid out, read from the tensors."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from .._kvtier import KvLayoutKind

__all__ = ["detect_layer_layout"]


def detect_layer_layout(shape: Sequence[int], stride: Sequence[int], block_size: int, want: Optional[KvLayoutKind]) -> Tuple[KvLayoutKind, Tuple[int, ...]]:
    """The physical layout kind of a layer tensor, and the permutation that puts its dims in
    physical order (outermost first).

    A 5-dim MHA tensor has dims (2, num_blocks, a, b, head_dim) where one of a, b is the
    block's tokens (size ``block_size``) and the other the KV heads; which one, and which is
    outer in memory, comes from the sizes and strides (a backend may hand out a permuted view).
    ``want`` (the configured kind) decides when heads == block_size and is checked otherwise.
    A 3-dim tensor is MLA."""
    if len(shape) == 3:
        return KvLayoutKind.MLA, (0, 1, 2)
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(
            f"kvtier: a layer tensor of shape {tuple(shape)} is neither (2, blocks, tokens|heads, heads|tokens, "
            "head_dim) nor MLA's (blocks, tokens, latent)"
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

