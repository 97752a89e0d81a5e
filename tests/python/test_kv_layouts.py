"""Every KV layout vLLM allocates, through WorkerSide.register (issue 24, problem 2).

The layer tensors are built the way vLLM's ``_reshape_kv_cache_tensors`` builds them (raw
int8 zeros, ``.view(dtype).view(physical shape).permute(inverse stride order)``), read the
way vLLM's kernels read them (``kv_halves``), registered, and checked: the engine's tensors
keep their shape, strides and dtype (its kernels keep working), the region holds their
bytes, and a chunk stored from one layout is retrieved byte for byte into another layout
of the same order through a real kvtier-server, and missed by a layout of another order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import pytest

torch = pytest.importorskip("torch")

import kvtier  # noqa: E402
from kvtier.integrations.core import KVTierConfig, LoadOp, StepPlan, StoreOp, WorkerSide  # noqa: E402
from kvtier.integrations.kv_layouts import BACKENDS, backend_dims, describe_layer  # noqa: E402
from kvtier_testing import FAST_TIMEOUTS_MS, wait_until  # noqa: E402

CT = 16  # tokens per chunk (the server's --chunk-size)
LAYERS, HEADS, D = 2, 2, 8


def vllm_tensor(shape: Sequence[int], order: Sequence[int], dtype: "torch.dtype") -> "torch.Tensor":
    """A layer tensor as vLLM's GPUModelRunner._reshape_kv_cache_tensors makes it: raw int8
    zeros viewed as ``dtype`` in the physical order, permuted back to the logical shape."""
    phys = tuple(shape[i] for i in order)
    inv = [list(order).index(i) for i in range(len(order))]
    n = 1
    for x in shape:
        n *= x
    elt = torch.empty((), dtype=dtype).element_size()
    return torch.zeros(n * elt, dtype=torch.int8).view(dtype).view(phys).permute(*inv)


@dataclass
class Layout:
    """One layout: the backend name kvtier is told, the logical shape as a function of (kernel
    blocks B, kernel block size N, heads H, head size D), vLLM's stride order, the order kvtier
    keys it by, and how vLLM's kernels read K and V out of it (each as [B, N, H, D])."""

    name: str
    backend: str
    shape: Callable[[int, int, int, int], Tuple[int, ...]]
    order: Tuple[int, ...]
    kind: str
    halves: Callable[["torch.Tensor", int, int, int, int], Tuple["torch.Tensor", ...]]
    mla: bool = False


def _packed_halves(t, B, N, H, D):  # FlashAttention & co: kv_cache.transpose(1, 2).split(D, -1)
    k, v = t.transpose(1, 2).split(D, dim=-1)
    return k, v


def _cpu_halves(t, B, N, H, D):  # cpu_attn.py: kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)
    k, v = t.view(B, H, 2 * N, D).chunk(2, dim=2)
    return k.transpose(1, 2), v.transpose(1, 2)


def _packed(B, N, H, D):
    return (B, H, N, 2 * D)


def _kv_first(B, N, H, D):
    return (2, B, N, H, D)


def _blocks_first(B, N, H, D):
    return (B, 2, N, H, D)


def _kv_first_halves(t, *_):
    return t[0], t[1]


def _blocks_first_halves(t, *_):
    return t[:, 0], t[:, 1]


LAYOUTS = {
    "flash_nhd": Layout("flash_nhd", "FLASH_ATTN", _packed, (0, 2, 1, 3), "NHD", _packed_halves),
    "flash_hnd": Layout("flash_hnd", "FLASH_ATTN", _packed, (0, 1, 2, 3), "HND", _packed_halves),
    "cpu": Layout("cpu", "CPU_ATTN", _packed, (0, 1, 2, 3), "HND", _cpu_halves),
    "kv_first_nhd": Layout("kv_first_nhd", "KV_FIRST", _kv_first, (0, 1, 2, 3, 4), "NHD", _kv_first_halves),
    "kv_first_hnd": Layout("kv_first_hnd", "KV_FIRST", _kv_first, (0, 1, 3, 2, 4), "HND", _kv_first_halves),
    "blocks_first_nhd": Layout(
        "blocks_first_nhd", "BLOCKS_FIRST", _blocks_first, (0, 1, 2, 3, 4), "NHD", _blocks_first_halves
    ),
    "blocks_first_hnd": Layout(
        "blocks_first_hnd", "BLOCKS_FIRST", _blocks_first, (0, 1, 3, 2, 4), "HND", _blocks_first_halves
    ),
    "mla": Layout(
        "mla", "FLASHMLA", lambda B, N, H, D: (B, N, D), (0, 1, 2), "MLA", lambda t, *_: (t.unsqueeze(2),), True
    ),
}


class Engine:
    """One worker of an engine whose layers are vLLM tensors of ``layout``."""

    def __init__(
        self,
        srv,
        layout: Layout,
        block_size: int = 4,
        kernel_block_size: int = 0,
        num_blocks: int = 24,
        dtype: "torch.dtype" = torch.float32,
        cache_dtype: str = "auto",
        backend=None,
        name: str = "layouts/tiny",
    ) -> None:
        self.layout = layout
        self.block_size = block_size
        self.kb = kernel_block_size or block_size
        self.per = block_size // self.kb
        self.kernel_blocks = num_blocks * self.per
        self.heads = 1 if layout.mla else HEADS
        self.head_dim = 40 if layout.mla else D
        shape = layout.shape(self.kernel_blocks, self.kb, self.heads, self.head_dim)
        self.tensors = {
            f"model.layers.{i}.self_attn.attn": vllm_tensor(shape, layout.order, dtype) for i in range(LAYERS)
        }
        self.before = [(t.shape, t.stride(), t.dtype) for t in self.tensors.values()]
        cfg = KVTierConfig(
            socket_path=str(srv.socket_path),
            model_name=name,
            block_size=block_size,
            chunk_tokens=CT,
            layout=layout.kind if layout.kind != "MLA" else "auto",
            timeouts_ms=dict(FAST_TIMEOUTS_MS),
            kv_cache_backend="auto" if backend is not None else layout.backend,
            cache_dtype=cache_dtype,
        )
        self.side = WorkerSide(cfg)
        kv_dtype = {"fp8": "fp8_e4m3"}.get(cache_dtype) if cache_dtype != "auto" else None
        self.side.register(self.tensors, dtype=kv_dtype, backend=backend)

    def halves(self, layer: int) -> Tuple["torch.Tensor", ...]:
        t = list(self.tensors.values())[layer]
        return self.layout.halves(t, self.kernel_blocks, self.kb, self.heads, self.head_dim)

    def rows(self, layer: int, block: int, token: int) -> List["torch.Tensor"]:
        """Every plane's [heads, head_dim] of (scheduler) block ``block``, token ``token``."""
        kblock, ktoken = block * self.per + token // self.kb, token % self.kb
        return [h[kblock, ktoken] for h in self.halves(layer)]

    def fill(self, blocks: Sequence[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            for b in blocks:
                for tok in range(self.block_size):
                    for r in self.rows(layer, b, tok):
                        raw = r.view(torch.uint8)  # the row's bytes (its last dimension is contiguous)
                        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))

    def same(self, blocks: Sequence[int], other: "Engine", other_blocks: Sequence[int]) -> bool:
        for layer in range(LAYERS):
            for b, ob in zip(blocks, other_blocks):
                for tok in range(self.block_size):
                    for mine, theirs in zip(self.rows(layer, b, tok), other.rows(layer, ob, tok)):
                        if not torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)):
                            return False
        return True

    def is_zero(self, blocks: Sequence[int]) -> bool:
        return all(
            not r.view(torch.uint8).any()
            for layer in range(LAYERS)
            for b in blocks
            for tok in range(self.block_size)
            for r in self.rows(layer, b, tok)
        )

    def store(self, rid: str, hashes: List[int], blocks: List[int]) -> None:
        self.side.end_step(StepPlan(stores=[StoreOp(rid, 0, hashes, blocks)]))
        wait_until(lambda: self.side.connector.stats()["pending_calls"] == 0, what="the store answered")

    def load(self, rid: str, hashes: List[int], blocks: List[int]) -> set:
        """Retrieves into ``blocks``; returns the blocks that did not land."""
        self.side.start_step(StepPlan(loads=[LoadOp(rid, 0, hashes, blocks, 0)], fence_blocks=blocks))
        wait_until(lambda: rid in (self.side.finished([])[1] or set()), what=f"{rid} finished receiving")
        return self.side.load_error_blocks()

    @property
    def model_id(self) -> int:
        """The model id the server gives this engine's registration."""
        layout = self.side.region.layout
        return kvtier.make_model_id(self.side.config.model_name, layout.model, layout.kind)

    def close(self) -> None:
        self.side.shutdown()


def check_kept(e: Engine) -> None:
    """The engine's tensors have the shape, strides and dtype vLLM allocated, and live in the
    region (each layer's first element at the region's layer base)."""
    region = e.side.region
    assert region is not None
    for (shape, stride, dtype), t, layer in zip(e.before, e.tensors.values(), range(LAYERS)):
        assert (t.shape, t.stride(), t.dtype) == (shape, stride, dtype)
        base = torch.frombuffer(region.layer(layer), dtype=torch.uint8).data_ptr()
        assert t.data_ptr() == base
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()  # torch < 2.0
        assert storage.nbytes() == region.layout.layer_bytes


def test_the_packed_layout_used_to_be_refused_and_now_registers_in_place(servers):
    # Before: ValueError "a layer tensor of shape (24, 2, 4, 16) is neither (2, blocks, ...)".
    srv = servers.start(chunk_tokens=CT)
    e = Engine(srv, LAYOUTS["flash_nhd"])
    try:
        check_kept(e)
        layout = e.side.region.layout
        assert layout.kind == kvtier.KvLayoutKind.NHD
        assert not layout.strides.dense and not layout.segment_contiguous
        # K|V per (token, head): the plane stride is one head's D elements.
        assert layout.strides.plane == D * 4 and layout.strides.head == 2 * D * 4
        # The engine's kernels' view and the region's bytes are one memory.
        k, v = e.halves(1)
        v[5, 3, 1, 2] = 7.5
        row = layout.offset_in_layer(1, 5, 3, 1) + 2 * 4
        raw = torch.frombuffer(e.side.region.layer(1), dtype=torch.uint8)
        assert raw[row : row + 4].view(torch.float32).item() == 7.5
    finally:
        e.close()


@pytest.mark.parametrize(
    "store_as,load_as",
    [
        ("flash_nhd", "kv_first_nhd"),
        ("kv_first_nhd", "flash_nhd"),
        ("blocks_first_nhd", "flash_nhd"),
        ("cpu", "kv_first_hnd"),
        ("flash_hnd", "cpu"),
        ("blocks_first_hnd", "flash_hnd"),
        ("mla", "mla"),
    ],
)
def test_a_chunk_stored_from_one_layout_loads_byte_for_byte_into_another_of_the_same_order(servers, store_as, load_as):
    srv = servers.start(chunk_tokens=CT)
    a = Engine(srv, LAYOUTS[store_as])
    b = Engine(srv, LAYOUTS[load_as])
    try:
        check_kept(a)
        check_kept(b)
        src, dst = [3, 7, 1, 12, 5, 9, 20, 2], [0, 4, 8, 11, 13, 14, 16, 17]  # two chunks of 4 blocks
        a.fill(src, seed=1)
        b.fill(dst[:1], seed=2)  # overwritten by the load
        a.store("s", [101, 102], src)
        assert b.load("l", [101, 102], dst) == set()
        assert b.same(dst, a, src)
    finally:
        a.close()
        b.close()


def test_a_layout_of_another_order_misses_the_chunks(servers):
    srv = servers.start(chunk_tokens=CT)
    a = Engine(srv, LAYOUTS["flash_nhd"])
    c = Engine(srv, LAYOUTS["cpu"])  # HND: another model id
    try:
        src = [3, 7, 1, 12]
        a.fill(src, seed=3)
        a.store("s", [201], src)
        assert a.model_id != c.model_id
        assert c.load("l", [201], [0, 1, 2, 3]) == {0, 1, 2, 3}
        assert c.is_zero([0, 1, 2, 3])
    finally:
        a.close()
        c.close()


def test_fp8_caches_are_uint8_tensors_keyed_by_their_fp8_format(servers):
    srv = servers.start(chunk_tokens=CT)
    a = Engine(srv, LAYOUTS["flash_nhd"], dtype=torch.uint8, cache_dtype="fp8")
    b = Engine(srv, LAYOUTS["kv_first_nhd"], dtype=torch.uint8, cache_dtype="fp8")
    c = Engine(srv, LAYOUTS["flash_nhd"], dtype=torch.float32)
    try:
        check_kept(a)
        assert a.side.region.layout.model.dtype == kvtier.DtypeKind.FP8_E4M3
        assert list(a.tensors.values())[0].dtype == torch.uint8
        assert a.model_id == b.model_id != c.model_id
        src, dst = [1, 2, 3, 4], [10, 11, 12, 13]
        a.fill(src, seed=4)
        a.store("s", [301], src)
        assert b.load("l", [301], dst) == set()
        assert b.same(dst, a, src)
    finally:
        for e in (a, b, c):
            e.close()


def test_kernel_blocks_smaller_than_the_scheduler_block_are_folded_when_they_follow_one_another(servers):
    # Scheduler blocks of 8 tokens, FlashAttention kernel blocks of 4 (NHD) and MLA's: two
    # kernel blocks per block, consecutive in the token dimension.
    srv = servers.start(chunk_tokens=CT)
    a = Engine(srv, LAYOUTS["flash_nhd"], block_size=8, kernel_block_size=4, num_blocks=12)
    b = Engine(srv, LAYOUTS["kv_first_nhd"], block_size=8, num_blocks=12)
    try:
        check_kept(a)
        layout = a.side.region.layout
        assert (layout.block_size, layout.num_blocks) == (8, 12)
        assert list(a.tensors.values())[0].shape[0] == 24  # kernel blocks
        src, dst = [5, 2, 9, 0], [1, 3, 4, 6]
        a.fill(src, seed=5)
        a.store("s", [401, 402], src)
        assert b.load("l", [401, 402], dst) == set()
        assert b.same(dst, a, src)
    finally:
        a.close()
        b.close()
    m = Engine(srv, LAYOUTS["mla"], block_size=8, kernel_block_size=4, num_blocks=12, name="layouts/mla")
    try:
        check_kept(m)
        assert m.side.region.layout.block_size == 8
    finally:
        m.close()


def test_kernel_blocks_whose_tokens_lie_at_no_one_stride_are_refused_naming_the_shape(servers):
    srv = servers.start(chunk_tokens=CT)
    for name in ("flash_hnd", "cpu"):  # HND: a kernel block's heads lie between its tokens and the next's
        with pytest.raises(ValueError, match=r"shape \(24, 2, 4, 16\) and strides .*do not follow one another"):
            Engine(srv, LAYOUTS[name], block_size=8, kernel_block_size=4, num_blocks=12)


def test_an_unsupported_layout_is_refused_with_its_shape_and_strides(servers):
    srv = servers.start(chunk_tokens=CT)
    # CPU_ATTN's packing needs the tokens and the packed dimension contiguous together; a
    # tensor permuted to NHD order is not a layout the CPU backend makes.
    t = vllm_tensor((24, HEADS, 4, 2 * D), (0, 2, 1, 3), torch.float32)
    side = WorkerSide(KVTierConfig(socket_path=str(srv.socket_path), model_name="m", block_size=4, chunk_tokens=CT,
                                   kv_cache_backend="CPU_ATTN"))
    with pytest.raises(ValueError, match=r"shape \(24, 2, 4, 16\) and strides \(128, 16, 32, 1\).*CPU_ATTN"):
        side.register({"l0": t})
    assert side.region is None
    # Rows that are not contiguous (a head_dim stride of 2).
    u = torch.zeros(2, 24, 4, HEADS, 2 * D)[..., ::2]
    side = WorkerSide(KVTierConfig(socket_path=str(srv.socket_path), model_name="m", block_size=4, chunk_tokens=CT))
    with pytest.raises(ValueError, match=r"strides \(3072, 128, 32, 16, 2\).*not contiguous"):
        side.register({"l0": u})
    # A backend name kvtier does not know.
    side = WorkerSide(KVTierConfig(socket_path=str(srv.socket_path), model_name="m", block_size=4, chunk_tokens=CT,
                                   kv_cache_backend="NO_SUCH_BACKEND"))
    with pytest.raises(ValueError, match="kv_cache_backend 'NO_SUCH_BACKEND'.*FLASH_ATTN"):
        side.register({"l0": t})
    # A 4-D tensor with no backend on the CPU is read as CPU_ATTN's (vLLM's CPU backend).
    side = WorkerSide(KVTierConfig(socket_path=str(srv.socket_path), model_name="m", block_size=4, chunk_tokens=CT))
    with pytest.raises(ValueError, match="CPU_ATTN"):
        side.register({"l0": t})


def test_a_cross_layer_tensor_is_refused_because_vllm_made_its_layer_views_first(servers):
    srv = servers.start(chunk_tokens=CT)
    side = WorkerSide(KVTierConfig(socket_path=str(srv.socket_path), model_name="m", block_size=4, chunk_tokens=CT))
    cross = torch.zeros(24, LAYERS, 4, HEADS, 2 * D)  # FlashAttention's (B, L, N, H, 2D)
    with pytest.raises(NotImplementedError, match=r"shape \(24, 2, 4, 2, 16\).*prefer_cross_layer_blocks False"):
        side.register_cross_layers(cross, "FLASH_ATTN")
    # vLLM calls it only for a connector that prefers cross-layer blocks: kvtier's does not.
    from kvtier.integrations import vllm as kv_vllm

    prop = kv_vllm.KVTierConnector.__dict__.get("prefer_cross_layer_blocks")
    assert prop is None or prop.fget(object.__new__(kv_vllm.KVTierConnector)) is False


class _FakeBackend:
    """A vLLM attention backend as vLLM defines one: classmethods get_name and
    get_kv_cache_shape (and a stride order)."""

    NAME = "FLASH_ATTN"
    SHAPE = staticmethod(lambda nb, bs, h, d: (nb, h, bs, 2 * d))

    @classmethod
    def get_name(cls) -> str:
        return cls.NAME

    @classmethod
    def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        if block_size % 16:
            raise ValueError("Block size must be a multiple of 16.")
        return cls.SHAPE(num_blocks, block_size, num_kv_heads, head_size)


class _FakeCpu(_FakeBackend):
    NAME = "CPU_ATTN"


class _FakeMla(_FakeBackend):
    NAME = "FLASHMLA"
    SHAPE = staticmethod(lambda nb, bs, h, d: (nb, bs, d))


class _FakeOld(_FakeBackend):
    NAME = "SOMETHING_NEW"
    SHAPE = staticmethod(lambda nb, bs, h, d: (2, nb, bs, h, d))


def test_the_dimensions_come_from_vllms_backend_called_with_sentinel_sizes():
    assert backend_dims(_FakeBackend).dims == ("blocks", "heads", "tokens", "kv_head_dim")
    assert backend_dims(_FakeBackend).packing == "row"
    assert backend_dims(_FakeCpu).packing == "block_head"
    assert backend_dims(_FakeMla).dims == ("blocks", "tokens", "latent")
    assert backend_dims(_FakeOld).dims == ("kv", "blocks", "tokens", "heads", "head_dim")
    assert "get_kv_cache_shape" in backend_dims(_FakeOld).source
    # A backend whose shape the sentinels cannot read falls back to the table by name.

    class Odd(_FakeBackend):
        NAME = "FLASHINFER"
        SHAPE = staticmethod(lambda nb, bs, h, d: (nb, 2 * h, bs, 3))  # nvfp4-like

    assert backend_dims(Odd) is BACKENDS["FLASHINFER"]
    assert backend_dims("cpu_attn") is BACKENDS["CPU_ATTN"]
    assert backend_dims("nothing") is None


def test_vllms_backend_class_decides_over_the_device(servers):
    # The CPU tensors of a FlashAttention-shaped layout are read per row when vLLM says
    # FLASH_ATTN, as CPU_ATTN's when it says that.
    srv = servers.start(chunk_tokens=CT)
    a = Engine(srv, LAYOUTS["flash_hnd"], backend=_FakeBackend)
    b = Engine(srv, LAYOUTS["cpu"], backend=_FakeCpu)
    try:
        assert a.side.region.layout.strides.plane == D * 4
        assert b.side.region.layout.strides.plane == 4 * D * 4  # block_size rows of K, then V
        src, dst = [1, 2, 3, 4], [5, 6, 7, 8]
        a.fill(src, seed=6)
        a.store("s", [501], src)
        assert b.load("l", [501], dst) == set()
        assert b.same(dst, a, src)
    finally:
        a.close()
        b.close()


def test_describe_layer_reads_the_cpu_layout_as_vllms_kernels_do():
    t = vllm_tensor((10, 3, 4, 2 * 5), (0, 1, 2, 3), torch.float16)  # CPU_ATTN, 5-element heads
    d = describe_layer(t.shape, t.stride(), 2, BACKENDS["CPU_ATTN"], block_size=4)
    assert d.kind == kvtier.KvLayoutKind.HND
    s = d.strides
    assert (s.plane, s.block, s.token, s.head) == (4 * 5 * 2, 3 * 4 * 10 * 2, 5 * 2, 4 * 10 * 2)
    k, v = t.view(10, 3, 8, 5).chunk(2, dim=2)
    v[7, 2, 3, 4] = 1.0  # V of block 7, head 2, token 3, element 4
    flat = t.contiguous().view(-1)
    at = (7 * s.block + 1 * s.plane + 3 * s.token + 2 * s.head) // 2 + 4
    assert flat[at] == 1.0
