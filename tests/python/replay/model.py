"""The model runners of the replay's workers.

* :class:`TinyDecoder`: a small decoder-only transformer (random weights from a fixed seed,
  RMSNorm, grouped-query attention with rotary positions, a SiLU MLP), CPU, fp32, whose
  attention writes each token's K and V into a paged KV cache and reads the context back
  through the request's block table. The cache tensors are views of the kvtier region (the
  connector moved them there at registration), so what kvtier loads is what attention reads,
  with no copy in between.

  Determinism: every per-token computation works on that token's row alone (vector-matrix
  products), and a token's attention reads exactly the keys 0..t, so a token's result depends
  only on its inputs and the earlier tokens' K/V, whatever the batch, the step split or the
  step in which the earlier K/V were computed (or loaded). Logits of a run that loads its
  prefix equal those of a run that computes it, bit for bit, iff the loaded K/V are exact.

  Beyond token ids it takes what vLLM's block hash covers (:class:`RequestInputs`): a LoRA-like
  adapter (a low-rank delta on the V projection, its weights drawn from the adapter's name),
  an "image" (embedding rows put in place of the token embeddings at its placeholder
  positions) and prompt embeddings (an embeddings-only prompt). Each changes the K/V of the
  positions it touches, so KV served to the wrong request shows in the logits.

  Tensor parallelism: with ``world_size`` > 1 each rank holds its share of the query and KV
  heads (the columns of wq, wk, wv and the adapter's delta, the rows of wo), computes their
  attention, and ``all_reduce`` sums the ranks' attention outputs (a torch.distributed gloo
  group across the replay's worker processes), as vLLM's row-parallel output projection does;
  the rest is replicated. The sum of two partials is the same on both ranks (IEEE addition
  commutes), so every rank holds the same residual stream.

* :class:`SyntheticRunner`: no model: each token's KV is a pattern of (token, position,
  layer, plane, rank, head, dim); every step checks that every position of every scheduled
  request holds its pattern (what was loaded, computed, or kept by vLLM's prefix cache).
  It runs on KV caches of any of :data:`KV_DTYPES` (vLLM allocates its KV cache in the
  model's dtype): the pattern is computed in float32 and cast to the cache's dtype, both
  where it is written and where it is checked, so the check stays exact.

The TinyDecoder computes in float32 and runs on float32 KV caches only
(:func:`check_runner_dtype`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch


@dataclass
class RequestInputs:
    """A request's model inputs beyond its token ids (vLLM's NewRequestData carries them)."""

    lora_name: Optional[str] = None
    mm: List[Tuple[int, torch.Tensor]] = field(default_factory=list)  # (placeholder offset, (length, hidden) rows)
    prompt_embeds: Optional[torch.Tensor] = None  # (num_prompt_tokens, hidden): an embeddings-only prompt


#: One request of a step: (tokens, start, end, block table, inputs or None).
Batched = Tuple[List[int], int, int, List[int], Optional[RequestInputs]]


def _kv_cache_shape(layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int) -> Tuple[int, ...]:
    if layout == "NHD":
        return (2, num_blocks, block_size, heads, head_dim)
    return (2, num_blocks, heads, block_size, head_dim)


#: The KV cache dtypes the replay allocates, by the name vLLM's model config gives them (with
#: ``cache_dtype`` "auto" vLLM's KV cache has the model's dtype).
KV_DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_dtype(name: str) -> torch.dtype:
    """The torch dtype of the KV cache dtype ``name`` (a key of :data:`KV_DTYPES`)."""
    if name not in KV_DTYPES:
        raise ValueError(f"replay: KV cache dtype {name!r} is not one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def check_runner_dtype(runner: str, dtype: str) -> None:
    """Refuses a runner that cannot run on KV caches of ``dtype``: the TinyDecoder ("model")
    computes in float32 and its logits are compared bit for bit, so it runs on float32 KV
    only; the synthetic runner runs on every dtype of :data:`KV_DTYPES`."""
    kv_dtype(dtype)
    if runner == "model" and dtype != "float32":
        raise ValueError(
            f"replay: the TinyDecoder (runner='model') runs on float32 KV caches only, not {dtype}: "
            "use runner='synthetic' for float16 or bfloat16 KV caches"
        )


def make_kv_caches(
    layout: str, num_layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: str = "float32"
):
    """vLLM's per-layer KV cache tensors (zeros) of ``dtype`` (a :data:`KV_DTYPES` name), by
    layer name."""
    shape = _kv_cache_shape(layout, num_blocks, block_size, heads, head_dim)
    t = kv_dtype(dtype)
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=t) for i in range(num_layers)}


class PagedKV:
    """Reads and writes token rows of one layer's paged cache (NHD or HND) through a table."""

    def __init__(self, cache: torch.Tensor, layout: str, block_size: int) -> None:
        self.cache = cache
        self.layout = layout
        self.bs = block_size

    def _index(self, table: List[int], positions: torch.Tensor):
        t = torch.tensor(table, dtype=torch.long)
        return t[positions // self.bs], positions % self.bs

    def write(self, table: List[int], positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (n, heads, head_dim) for `positions`."""
        blocks, offs = self._index(table, positions)
        if self.layout == "NHD":
            self.cache[0, blocks, offs] = k
            self.cache[1, blocks, offs] = v
        else:
            self.cache[0, blocks, :, offs] = k
            self.cache[1, blocks, :, offs] = v

    def read(self, table: List[int], n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions 0..n-1: (n, heads, head_dim) each (a gather: a copy)."""
        blocks, offs = self._index(table, torch.arange(n))
        if self.layout == "NHD":
            return self.cache[0, blocks, offs], self.cache[1, blocks, offs]
        return self.cache[0, blocks, :, offs], self.cache[1, blocks, :, offs]


class TinyDecoder:
    def __init__(
        self,
        vocab: int = 101,
        hidden: int = 32,
        layers: int = 3,
        q_heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 8,
        mlp: int = 64,
        seed: int = 1234,
        max_positions: int = 4096,
        rank: int = 0,
        world_size: int = 1,
        all_reduce: Optional[Callable[[torch.Tensor], None]] = None,
    ) -> None:
        assert q_heads % world_size == 0 and kv_heads % world_size == 0, "heads split evenly over the ranks"
        assert world_size == 1 or all_reduce is not None, "tensor parallelism sums the ranks' attention outputs"
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale=None):
            scale = scale if scale is not None else 1.0 / math.sqrt(shape[0])
            return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

        self.vocab, self.hidden, self.layers = vocab, hidden, layers
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.embed = w(vocab, hidden, scale=1.0)
        self.params = []
        for _ in range(layers):
            self.params.append(
                dict(
                    norm1=1.0 + 0.1 * w(hidden, scale=1.0),
                    wq=w(hidden, q_heads * head_dim),
                    wk=w(hidden, kv_heads * head_dim),
                    wv=w(hidden, kv_heads * head_dim),
                    wo=w(q_heads * head_dim, hidden),
                    norm2=1.0 + 0.1 * w(hidden, scale=1.0),
                    w1=w(hidden, mlp),
                    w2=w(mlp, hidden),
                )
            )
        self.norm = 1.0 + 0.1 * w(hidden, scale=1.0)
        self.lm_head = w(hidden, vocab)
        self.adapter_rank = 4
        self._adapters: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        # This rank's heads: query heads [qh0, qh0 + q_heads/ws), KV heads [kh0, kh0 + kv_heads/ws).
        self.rank, self.world_size, self.all_reduce = rank, world_size, all_reduce
        self.local_q, self.local_kv = q_heads // world_size, kv_heads // world_size
        if world_size > 1:
            q_cols = slice(rank * self.local_q * head_dim, (rank + 1) * self.local_q * head_dim)
            self._kv_cols = slice(rank * self.local_kv * head_dim, (rank + 1) * self.local_kv * head_dim)
            for p in self.params:
                p["wq"] = p["wq"][:, q_cols].contiguous()
                p["wk"] = p["wk"][:, self._kv_cols].contiguous()
                p["wv"] = p["wv"][:, self._kv_cols].contiguous()
                p["wo"] = p["wo"][q_cols, :].contiguous()
        else:
            self._kv_cols = slice(None)
        inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        ang = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos, self.sin = torch.cos(ang), torch.sin(ang)

    def adapter(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """The LoRA-like delta (A: hidden x r, B: r x this rank's V columns) of adapter `name`,
        drawn from a generator seeded by the name's SHA-256 (the same in every process)."""
        if name not in self._adapters:
            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)
            g = torch.Generator().manual_seed(seed)
            a = torch.randn(self.hidden, self.adapter_rank, generator=g, dtype=torch.float32) / math.sqrt(self.hidden)
            b = torch.randn(self.adapter_rank, self.kv_heads * self.head_dim, generator=g, dtype=torch.float32) * 0.5
            self._adapters[name] = (a, b[:, self._kv_cols].contiguous())
        return self._adapters[name]

    def _input_rows(self, tokens: List[int], start: int, end: int, inputs: Optional[RequestInputs]) -> List[torch.Tensor]:
        """The input embedding of each position start..end-1: the prompt embeddings, an image's
        rows at its placeholder positions, else the token's embedding."""
        rows = []
        for p in range(start, end):
            row = None
            if inputs is not None:
                if inputs.prompt_embeds is not None and p < inputs.prompt_embeds.shape[0]:
                    row = inputs.prompt_embeds[p]
                for offset, mm_rows in inputs.mm:
                    if offset <= p < offset + mm_rows.shape[0]:
                        row = mm_rows[p - offset]
            rows.append((self.embed[tokens[p]] if row is None else row).clone())
        return rows

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean() + 1e-6) * weight

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: (heads, head_dim), rotated pairwise by position pos."""
        c, s = self.cos[pos], self.sin[pos]
        x1, x2 = x[:, 0::2], x[:, 1::2]
        out = torch.empty_like(x)
        out[:, 0::2] = x1 * c - x2 * s
        out[:, 1::2] = x1 * s + x2 * c
        return out

    def forward(
        self, tokens: List[int], start: int, end: int, table: List[int], caches: List[PagedKV]
    ) -> torch.Tensor:
        """Computes positions start..end-1 of `tokens` (K/V of 0..start-1 are in the cache),
        writes their K/V and returns the logits of the last one (vocab,)."""
        return self.forward_batch([(tokens, start, end, table, None)], caches)[0]

    def forward_batch(
        self, batch: List[Batched], caches: List[PagedKV], before_layer: Optional[Callable[[int], None]] = None
    ) -> List[torch.Tensor]:
        """forward() for every (tokens, start, end, table, inputs) of a step, layer by layer as
        an engine runs a batch: ``before_layer(layer)`` runs before the layer reads any K/V
        (vLLM's wait_for_layer_load). Each request's result is the same as alone."""
        group = self.q_heads // self.kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        nq, nkv = self.local_q, self.local_kv
        states = [self._input_rows(tokens, start, end, inputs) for tokens, start, end, _, inputs in batch]
        for layer, (p, cache) in enumerate(zip(self.params, caches)):
            if before_layer is not None:
                before_layer(layer)
            attn: List[List[torch.Tensor]] = []  # per request, per token: this rank's attention output
            for (tokens, start, end, table, inputs), xs in zip(batch, states):
                n = end - start
                delta = self.adapter(inputs.lora_name) if inputs is not None and inputs.lora_name is not None else None
                qs, ks, vs = [], [], []
                for i in range(n):
                    h = self._rms(xs[i], p["norm1"])
                    q = (h[None, :] @ p["wq"]).view(nq, self.head_dim)
                    k = (h[None, :] @ p["wk"]).view(nkv, self.head_dim)
                    v = h[None, :] @ p["wv"]
                    if delta is not None:
                        v = v + (h[None, :] @ delta[0]) @ delta[1]
                    qs.append(self._rope(q, start + i))
                    ks.append(self._rope(k, start + i))
                    vs.append(v.view(nkv, self.head_dim))
                cache.write(table, torch.arange(start, end), torch.stack(ks), torch.stack(vs))
                K, V = cache.read(table, end)  # (end, local kv heads, head_dim)
                Kh = [K[:, h, :].contiguous() for h in range(nkv)]
                Vh = [V[:, h, :].contiguous() for h in range(nkv)]
                outs = []
                for i in range(n):
                    t = start + i + 1  # keys 0..start+i
                    heads = []
                    for hq in range(nq):
                        kh = hq // group
                        scores = (qs[i][hq][None, :] @ Kh[kh][:t].t()) * scale
                        probs = torch.softmax(scores, dim=-1)
                        heads.append((probs @ Vh[kh][:t])[0])
                    outs.append((torch.cat(heads)[None, :] @ p["wo"])[0])
                attn.append(outs)
            if self.world_size > 1:  # the row-parallel output projection: sum the ranks' partials
                flat = torch.stack([o for outs in attn for o in outs])
                self.all_reduce(flat)
                it = iter(flat)
                attn = [[next(it) for _ in outs] for outs in attn]
            for xs, outs in zip(states, attn):
                for i, o in enumerate(outs):
                    x = xs[i] + o
                    h2 = self._rms(x, p["norm2"])
                    xs[i] = x + (torch.nn.functional.silu(h2[None, :] @ p["w1"]) @ p["w2"])[0]
        return [(self._rms(xs[-1], self.norm)[None, :] @ self.lm_head)[0] for xs in states]


class SyntheticRunner:
    """KV that is a pattern of each token's identity; checks every position each step.

    A row's identity is ``(token * 7919 + position * 104729 + layer * 31 + plane * 17 + rank
    * 7 + context) % 65521`` (:meth:`identity`), where ``context`` (:meth:`context`) stands for
    what a real model's K/V at a position depends on besides its own token: every earlier
    token and the request's inputs at and before the position (its adapter, its images' rows,
    its prompt embeddings). So KV served to a request whose prefix or inputs differ (a chunk
    key that failed to cover them) is caught as a real model would show it. :meth:`rows`
    turns identities into (heads, head_dim) rows, in float32; :meth:`pattern` is them cast to
    the cache's dtype, what is written and what every row read back is compared with (``!=``:
    exact).

    * float32: ``identity + head * 0.25 + dim / 64`` (exact in float32).
    * float16, bfloat16: that float32 pattern does not survive the cast (bfloat16 keeps 8
      significant bits, so near 60000 its steps are 256 apart; float16 keeps 11 and rounds
      65520 up to inf): many identities would round to one row, and a wrong block could
      pass. Instead element ``i`` of the flattened row (``head * head_dim + dim``) holds
      ``16 * nibble(identity, i % 4) + (dim + 3 * head) % 16``: integers 0..255, which both
      dtypes hold exactly, so the cast is exact; every row carries its identity's four
      nibbles (rows of different identities differ) and each element a tag of its place
      (heads swapped differ up to 16 heads, dims moved by less than 16 differ). Needs
      ``heads * head_dim >= 4``.
    """

    def __init__(self, layout: str, rank: int, block_size: int, heads: int, head_dim: int, dtype: str = "float32") -> None:
        self.layout, self.rank, self.bs = layout, rank, block_size
        self.heads, self.head_dim = heads, head_dim
        self.dtype = kv_dtype(dtype)
        self._hd = torch.arange(heads, dtype=torch.float32)[:, None] * 0.25 + torch.arange(
            head_dim, dtype=torch.float32
        )[None, :] * (1.0 / 64)
        if self.dtype != torch.float32:
            assert heads * head_dim >= 4, "a 16-bit row holds its identity's 4 nibbles in 4 elements"
            i = torch.arange(heads * head_dim, dtype=torch.long)
            self._shift, self._tag = 4 * (i % 4), (i % head_dim + 3 * (i // head_dim)) % 16

    @staticmethod
    def _digest(rows: torch.Tensor) -> torch.Tensor:
        """(n,) int64 in 0..65520: an exact digest of each row of ``rows`` (n, ...) from its
        bits (integer arithmetic: equal in every process for equal rows)."""
        flat = rows.detach().reshape(rows.shape[0], -1).contiguous()
        ints = flat.view(torch.int32 if flat.element_size() == 4 else torch.int16 if flat.element_size() == 2 else torch.int64)
        ints = ints.to(torch.long) % 65521
        weights = (torch.arange(1, ints.shape[1] + 1, dtype=torch.long) * 40503) % 65521
        return (ints * weights[None, :]).sum(dim=1) % 65521

    @classmethod
    def _input_salt(cls, inputs: "RequestInputs", n: int) -> torch.Tensor:
        """(n,) int64: what the request's inputs add at each position (cached on ``inputs``,
        which lives as long as its request): its adapter's at every position, an image's at
        each of its placeholder positions (its rows' digest and the place in it), a prompt
        embedding's row digest at each prompt position."""
        cached = getattr(inputs, "_synthetic_salt", None)
        if cached is None or cached[0] < n:
            covered = max([n] + [off + rows.shape[0] for off, rows in inputs.mm]
                          + ([inputs.prompt_embeds.shape[0]] if inputs.prompt_embeds is not None else []))
            salt = torch.zeros(covered, dtype=torch.long)
            if inputs.lora_name is not None:
                salt += int.from_bytes(hashlib.sha256(inputs.lora_name.encode()).digest()[:4], "little") % 65521
            for off, rows in inputs.mm:
                where = torch.arange(off, off + rows.shape[0])
                salt[where] += cls._digest(rows) * 3 + (where - off) * 7 + 11
            if inputs.prompt_embeds is not None:
                salt[: inputs.prompt_embeds.shape[0]] += cls._digest(inputs.prompt_embeds) * 5
            cached = (covered, salt % 65521)
            inputs._synthetic_salt = cached  # type: ignore[attr-defined]
        return cached[1][:n]

    def context(self, tokens: List[int], n: int, inputs: Optional["RequestInputs"] = None) -> torch.Tensor:
        """(n,) int64 in 0..65520: position p's context, a running sum over positions 0..p of
        ``(token + input salt) * w(q)`` with a weight per position (1..65520, so mod the
        prime 65521 a difference never cancels): any earlier token or input that differs, or
        is moved, moves every later position's context."""
        q = torch.arange(n, dtype=torch.long)
        value = torch.tensor(tokens[:n], dtype=torch.long) % 65521
        if inputs is not None:
            value = (value + self._input_salt(inputs, n)) % 65521
        weight = (q * 48271) % 65520 + 1
        return torch.cumsum((value * weight) % 65521, 0) % 65521

    def identity(
        self, tokens: List[int], positions: torch.Tensor, layer: int, plane: int, inputs: Optional["RequestInputs"] = None
    ) -> torch.Tensor:
        """The identity (0..65520) of each row: (len(positions),) int64."""
        tok = torch.tensor(tokens, dtype=torch.long)[positions]
        n = int(positions.max()) + 1 if positions.numel() else 0
        ctx = self.context(tokens, n, inputs)[positions]
        return (tok * 7919 + positions * 104729 + layer * 31 + plane * 17 + self.rank * 7 + ctx) % 65521

    def rows(self, identity: torch.Tensor) -> torch.Tensor:
        """The float32 rows (n, heads, head_dim) of identities (n,)."""
        if self.dtype == torch.float32:
            return identity.to(torch.float32)[:, None, None] + self._hd[None, :, :]
        nibbles = (identity[:, None] >> self._shift[None, :]) & 0xF
        return (nibbles * 16 + self._tag[None, :]).to(torch.float32).view(-1, self.heads, self.head_dim)

    def pattern(
        self, tokens: List[int], positions: torch.Tensor, layer: int, plane: int, inputs: Optional["RequestInputs"] = None
    ) -> torch.Tensor:
        """The rows of ``positions``, in the cache's dtype (computed in float32, then cast)."""
        return self.rows(self.identity(tokens, positions, layer, plane, inputs)).to(self.dtype)

    def forward(self, tokens: List[int], start: int, end: int, table: List[int], caches: List[PagedKV]) -> Tuple[int, int]:
        """Writes positions start..end-1, then checks 0..end-1. Returns (mismatched rows,
        sampled token)."""
        return self.forward_batch([(tokens, start, end, table, None)], caches)[0]

    def forward_batch(
        self, batch: List[Batched], caches: List[PagedKV], before_layer: Optional[Callable[[int], None]] = None
    ) -> List[Tuple[int, int]]:
        """forward() for every request of a step, layer by layer (``before_layer(layer)``
        first, as vLLM's wait_for_layer_load): (mismatched rows, sampled token) each."""
        bad = [0] * len(batch)
        for layer, cache in enumerate(caches):
            if before_layer is not None:
                before_layer(layer)
            for j, (tokens, start, end, table, inputs) in enumerate(batch):
                new = torch.arange(start, end)
                cache.write(table, new, self.pattern(tokens, new, layer, 0, inputs), self.pattern(tokens, new, layer, 1, inputs))
                every = torch.arange(end)
                k, v = cache.read(table, end)
                bad[j] += int((k != self.pattern(tokens, every, layer, 0, inputs)).flatten(1).any(dim=1).sum())
                bad[j] += int((v != self.pattern(tokens, every, layer, 1, inputs)).flatten(1).any(dim=1).sum())
        return [(bad[j], (sum(tokens[-3:]) * 31 + end) % 101) for j, (tokens, _, end, _, _) in enumerate(batch)]
