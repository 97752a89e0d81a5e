"""What names a request's chunks besides their tokens: the per-chunk key material.

vLLM tells two requests with the same token ids apart when their KV differs for another
reason (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``): the LoRA
adapter, the multimodal inputs whose embeddings replace placeholder tokens, the prompt
embeddings of a prompt given as embeddings (whose token ids are all zero), and the request's
cache salt. kvtier's chunk keys cover the same, but computed so that they are equal across
processes, restarts and machines (vLLM's block hashes are not: they chain on ``NONE_HASH``,
random per process unless ``PYTHONHASHSEED`` is set, so kvtier never reads them; nor does it
use Python's ``hash()``, randomized per process).

A chunk's key is ``TokenHasher.next(prefix, tokens, extra)`` (core/token_hasher.hpp): the
rolling hash over the chunk's token ids and, after them, its ``extra`` bytes. A chunk that
depends on nothing but its tokens has an empty extra, which hashes exactly as kvtier always
hashed tokens, so the keys of plain prompts (every C++ engine, the mini engine) never move.
The request's cache salt is not in the extras: it is folded into the model id of every chunk
of the request (``salted_model_id``), which keeps two salts apart in every chunk, not only
the first.

The extra bytes of one chunk, version 1 (docs/integration.md, "vLLM", has the same table)::

    b"kvtier.extra.v1"                      only when at least one field follows, else b""
    then fields, each  tag (1 byte) || u32 LE payload length || payload, in this order:
    b"L"  the LoRA adapter's name (UTF-8)                        every chunk of the request
    b"M"  one per multimodal input whose placeholder range       sorted by (offset, length,
          overlaps the chunk: u32 len || modality (UTF-8),       identifier, modality)
          u32 len || identifier (UTF-8), i64 LE offset of the
          range's start RELATIVE to the chunk's first token
          (negative when the input began in an earlier chunk),
          u64 LE length of the range
    b"E"  the prompt embeddings of the chunk's prompt positions  chunks with prompt positions
          (rows ``[max(start, 0), min(end, num_prompt_tokens))``) of a request with embeddings
          u32 len || dtype name (ASCII, "float16", "bfloat16", ...), u32 LE ndim, u64 LE per
          dimension (the slice's shape), then the 32-byte SHA-256 of the slice's bytes
          (row-major, the tensor's own element encoding)
    b"T"  mixed prompts only (``prompt_is_token_ids``): u64 LE count, then one byte (0 or 1)
          per prompt position of the chunk: which positions are token ids

The placeholder boundary rule: a multimodal input enters the key of EVERY chunk that holds
at least one position of its placeholder range (start, middle or end of the range; vLLM's
``is_embed`` mask is ignored, as vLLM does), with the range given relative to that chunk. The
KV of those positions is computed from the input's embeddings, so two requests whose inputs
differ must differ there; a chunk that lies entirely before the range carries nothing of it
(its KV cannot depend on later positions: causal attention), so requests that share a text
before an image still share those chunks; a chunk entirely after the range carries nothing of
it either, since the chain (the prefix hash) already holds it. Identical requests build
identical bytes, so they hit. The offset is relative (as vLLM's) because the chunk's absolute
place is already fixed by the chain; either would separate the same requests.

A chunk's extra depends only on the request's inputs at the chunk's own positions, never on
how many tokens the request has: after a preemption, a request whose sequence grew by output
tokens keys its prompt chunks exactly as before, and a chunk that holds output tokens is
keyed by their token ids (outputs are always embedded from their ids: no multimodal input or
prompt embedding can cover them) plus the adapter, the same way a later request whose prompt
holds those tokens keys it.

Not covered (docs/integration.md, "vLLM: what names a chunk"): EAGLE's successor hashing
(vLLM adds a block's next token to its hash for the drafter; kvtier declares no support for
it, so vLLM keeps its ordinary hasher), and any input vLLM does not hash either.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

__all__ = [
    "EXTRA_VERSION",
    "MultiModalSpan",
    "RequestKeys",
    "chunk_extras",
    "request_keys",
]

log = logging.getLogger("kvtier")

#: The leading bytes of every non-empty extra; a change of the encoding bumps the version.
EXTRA_VERSION = b"kvtier.extra.v1"


@dataclass(frozen=True)
class MultiModalSpan:
    """One multimodal input as the key sees it: its content's identifier (vLLM's
    ``MultiModalFeatureSpec.identifier``: the encoder-cache hash of the item, with the LoRA
    prefix when one applies), its modality and its placeholder range in the sequence."""

    identifier: str
    modality: str
    offset: int
    length: int


@dataclass
class RequestKeys:
    """A request's key material: what :class:`~kvtier.integrations.scheduler_side.SchedulerSide`
    hashes to name its chunks.

    ``extras``: one ``bytes`` per full chunk of ``tokens`` (``b""`` for a chunk that depends on
    its tokens alone), or ``None`` when no chunk has any (a plain prompt: the fast path).
    ``uncacheable``: why the request cannot be keyed safely (it is then neither looked up nor
    stored), or ``None``. ``lora_name`` and ``lora_id`` (vLLM's ``lora_request.lora_name`` and
    ``lora_int_id``; ``None`` and -1 without an adapter) go into the chunks' descriptions for
    a server's KV events (the name is in ``extras`` already)."""

    tokens: List[int]
    extras: Optional[List[bytes]]
    num_prompt_tokens: int
    cache_salt: str = ""
    uncacheable: Optional[str] = None
    lora_name: Optional[str] = None
    lora_id: int = -1


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return _u32(len(b)) + b


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _u32(len(payload)) + payload


def _dtype_name(t: Any) -> str:
    name = str(getattr(t, "dtype", ""))
    return name[len("torch.") :] if name.startswith("torch.") else name


def _embeds_field(rows: Any) -> bytes:
    """The "E" payload of a slice of prompt embeddings (a torch tensor or a numpy array)."""
    shape = tuple(int(d) for d in rows.shape)
    if hasattr(rows, "detach"):  # torch: its raw bytes in its own dtype (bf16 has no numpy type)
        import torch

        flat = rows.detach().reshape(-1).cpu().contiguous()
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    else:
        import numpy

        data = numpy.ascontiguousarray(rows).tobytes()
    head = _str(_dtype_name(rows)) + _u32(len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
    return _field(b"E", head + hashlib.sha256(data).digest())


def chunk_extras(
    num_tokens: int,
    chunk_tokens: int,
    *,
    num_prompt_tokens: Optional[int] = None,
    lora_name: Optional[str] = None,
    mm_spans: Sequence[MultiModalSpan] = (),
    prompt_embeds: Any = None,
    prompt_is_token_ids: Optional[Sequence[bool]] = None,
) -> Optional[List[bytes]]:
    """The extra bytes of each full chunk of a sequence of ``num_tokens`` tokens (the module
    docstring has the encoding), or ``None`` when every one would be empty."""
    if chunk_tokens <= 0:
        raise ValueError(f"kvtier: chunk_tokens must be positive (got {chunk_tokens})")
    n_prompt = num_tokens if num_prompt_tokens is None else int(num_prompt_tokens)
    if lora_name is None and not mm_spans and prompt_embeds is None and prompt_is_token_ids is None:
        return None
    spans = sorted(mm_spans, key=lambda s: (s.offset, s.length, s.identifier, s.modality))
    lora = _field(b"L", lora_name.encode("utf-8")) if lora_name is not None else b""
    out: List[bytes] = []
    any_extra = False
    for start in range(0, (num_tokens // chunk_tokens) * chunk_tokens, chunk_tokens):
        end = start + chunk_tokens
        fields = [lora]
        for s in spans:
            if s.offset < end and start < s.offset + s.length:
                fields.append(
                    _field(b"M", _str(s.modality) + _str(s.identifier) + struct.pack("<qQ", s.offset - start, s.length))
                )
        p_end = min(end, n_prompt)
        if prompt_embeds is not None and start < p_end:
            fields.append(_embeds_field(prompt_embeds[start:p_end]))
        if prompt_is_token_ids is not None and start < p_end:
            mask = bytes(1 if bool(x) else 0 for x in prompt_is_token_ids[start:p_end])
            fields.append(_field(b"T", struct.pack("<Q", len(mask)) + mask))
        body = b"".join(fields)
        if body:
            any_extra = True
            out.append(EXTRA_VERSION + body)
        else:
            out.append(b"")
    return out if any_extra else None


def _mm_spans(request: Any) -> Tuple[List[MultiModalSpan], Optional[str]]:
    """vLLM's ``request.mm_features`` as spans, or why they cannot key the request."""
    features = getattr(request, "mm_features", None)
    if features is None:
        if getattr(request, "mm_positions", None) or getattr(request, "mm_hashes", None):
            return [], "the request's multimodal inputs are not in mm_features (an older vLLM): they cannot be keyed"
        return [], None
    spans = []
    for f in features:
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        pos = getattr(f, "mm_position", None)
        if not ident or pos is None:
            return [], "a multimodal input has no identifier or no placeholder range: it cannot be keyed"
        spans.append(MultiModalSpan(str(ident), str(getattr(f, "modality", "") or ""), int(pos.offset), int(pos.length)))
    return spans, None


def request_keys(request: Any, chunk_tokens: int) -> RequestKeys:
    """The key material of a vLLM ``Request`` (vllm/v1/request.py; or the replay's stand-in):
    ``all_token_ids`` (zeros at the positions of an embeddings-only prompt, as vLLM has them),
    ``num_prompt_tokens``, ``cache_salt``, and per chunk the adapter (``lora_request.lora_name``),
    the multimodal inputs (``mm_features``: identifier, modality, ``mm_position`` offset and
    length), the prompt embeddings (``prompt_embeds``) and the mixed-prompt mask
    (``prompt_is_token_ids``)."""
    tokens = list(request.all_token_ids)
    n_prompt = int(getattr(request, "num_prompt_tokens", len(tokens)))
    salt = getattr(request, "cache_salt", None) or ""
    lora = getattr(request, "lora_request", None)
    lora_name = None
    lora_id = -1
    if lora is not None:
        lora_name = getattr(lora, "lora_name", None)
        if lora_name is None:
            return RequestKeys(tokens, None, n_prompt, salt, "the request's lora_request has no lora_name")
        lora_name = str(lora_name)
        int_id = getattr(lora, "lora_int_id", None)
        lora_id = int(int_id) if isinstance(int_id, int) and int_id >= 0 else -1
    spans, why = _mm_spans(request)
    if why is not None:
        return RequestKeys(tokens, None, n_prompt, salt, why)
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None and (not hasattr(embeds, "shape") or len(embeds.shape) < 1 or int(embeds.shape[0]) < n_prompt):
        return RequestKeys(
            tokens, None, n_prompt, salt, f"prompt_embeds of shape {getattr(embeds, 'shape', None)} do not cover the {n_prompt} prompt tokens"
        )
    mask = getattr(request, "prompt_is_token_ids", None)
    extras = chunk_extras(
        len(tokens),
        chunk_tokens,
        num_prompt_tokens=n_prompt,
        lora_name=lora_name,
        mm_spans=spans,
        prompt_embeds=embeds,
        prompt_is_token_ids=mask,
    )
    return RequestKeys(tokens, extras, n_prompt, salt, lora_name=lora_name, lora_id=lora_id)
