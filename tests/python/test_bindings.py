"""The bindings themselves: layouts, hashes and ids as the C++ side computes them, zero-copy
region views, errors as exceptions, and the GIL released while a call waits."""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

import kvtier
from kvtier import DtypeKind, KvLayoutKind, ModelShape, PagedKvLayout


def test_the_package_says_what_it_exports():
    for name in kvtier.__all__:
        assert hasattr(kvtier, name), name
    assert kvtier.__version__.count(".") == 2
    assert kvtier.PROTOCOL_VERSION == 5


def test_chunk_hashes_follow_the_documented_encoding():
    # h(-1) = XXH3-128("kvtier.root.v1"); h(i) = XXH3-128(h(i-1) as lo, hi LE || tokens u32 LE).
    h = kvtier.TokenHasher(4)
    root = xxhash.xxh3_128_intdigest(b"kvtier.root.v1")
    assert h.root() == root
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    want, prev = [], root
    for c in range(2):
        data = struct.pack("<QQ", prev & (2**64 - 1), prev >> 64) + struct.pack("<4I", *tokens[4 * c : 4 * c + 4])
        prev = xxhash.xxh3_128_intdigest(data)
        want.append(prev)
    assert h.chunk_hashes(tokens) == want  # the trailing partial chunk is not hashed
    assert h.chunk_hashes(np.array(tokens, dtype=np.int64)) == want
    assert h.chunk_hashes(torch.tensor(tokens)) == want
    assert kvtier.TokenHasher(4, kvtier.HashAlgorithm.SHA256).chunk_hashes(tokens) != want


def test_a_long_sequence_hashes_the_same_with_the_gil_released():
    # From 65536 tokens hashing releases the GIL (docs/python.md, "The GIL"); the prefix chunks
    # hash as they do in a short sequence, with and without extras.
    h = kvtier.TokenHasher(256)
    tokens = np.arange(1, 70001, dtype=np.uint32)
    short = tokens[:1024]
    long_hashes = h.chunk_hashes(tokens)
    assert len(long_hashes) == 70000 // 256
    assert long_hashes[:4] == h.chunk_hashes(short)
    extras = [b"lora:1"] + [b""] * (70000 // 256 - 1)
    assert h.chunk_hashes(tokens, extras)[:4] == h.chunk_hashes(short, extras[:4])
    assert h.chunk_hashes(tokens, extras)[0] != long_hashes[0]


def test_model_ids_fold_dtype_layout_and_salt():
    m = ModelShape(2, 2, 16, DtypeKind.BF16)
    # Encoding 2: name || 0 || u32 layers, heads, head dim, u8 dtype, attention, layout || 0 || salt.
    fields = struct.pack("<3I3B", 2, 2, 16, int(DtypeKind.BF16), 0, int(KvLayoutKind.HND))
    want = xxhash.xxh3_64_intdigest(b"m\0" + fields + b"\0" + b"s")
    assert kvtier.make_model_id("m", m, KvLayoutKind.HND, "s") == want
    nhd = kvtier.make_model_id("m", m, KvLayoutKind.NHD)
    assert nhd != kvtier.make_model_id("m", m, KvLayoutKind.HND)
    fp16 = ModelShape(2, 2, 16, DtypeKind.FP16)
    assert nhd != kvtier.make_model_id("m", fp16)
    assert kvtier.salted_model_id(nhd, "") == nhd
    assert kvtier.salted_model_id(nhd, "t") != nhd
    key = kvtier.ChunkKey(nhd, 2, 1, 2**127 + 5)
    assert key.hash == 2**127 + 5 and key.rank == 1 and len(key.encode()) > 16
    with pytest.raises(ValueError):
        kvtier.ChunkKey(nhd, 1, 0, 2**128)


@pytest.mark.parametrize("order", [KvLayoutKind.NHD, KvLayoutKind.HND])
def test_region_layers_are_writable_views_of_the_shared_memory(order):
    m = ModelShape(3, 2, 4, DtypeKind.FP32)
    layout = PagedKvLayout(m, 4, 6, order)
    region = kvtier.KvRegion.create(layout)
    assert region.bytes == kvtier.KvRegion.bytes_for(layout)
    ts = kvtier.torch_layers(region)
    arrays = kvtier.numpy_layers(region)
    assert len(ts) == 3
    shape = (2, 6, 4, 2, 4) if order == KvLayoutKind.NHD else (2, 6, 2, 4, 4)
    assert tuple(ts[0].shape) == shape == kvtier.layer_shape(layout)
    # The same bytes: a write through torch is seen by numpy and through the raw buffer.
    plane, block, token, head, dim = 1, 5, 3, 1, 2
    idx = (plane, block, token, head, dim) if order == KvLayoutKind.NHD else (plane, block, head, token, dim)
    ts[2][idx] = 42.5
    assert arrays[2][idx] == 42.5
    raw = memoryview(region.layer(2))
    off = layout.offset_in_layer(plane, block, token, head) + 4 * dim
    assert struct.unpack_from("<f", raw, off)[0] == 42.5
    # Views keep the region alive.
    del region, arrays, raw
    import gc

    gc.collect()
    ts[0].fill_(1.0)
    assert float(ts[0].sum()) == ts[0].numel()


def test_bf16_regions_give_torch_bfloat16_and_numpy_raw_bits():
    region = kvtier.KvRegion.create(PagedKvLayout(ModelShape(1, 1, 8, DtypeKind.BF16), 2, 3))
    t = kvtier.torch_layers(region)[0]
    a = kvtier.numpy_layers(region)[0]
    assert t.dtype == torch.bfloat16 and a.dtype == np.uint16
    t[0, 0, 0, 0, 0] = 1.0
    assert a[0, 0, 0, 0, 0] == 0x3F80  # bf16 1.0


def test_generations_count_reuses():
    region = kvtier.KvRegion.create(PagedKvLayout(ModelShape(1, 1, 4, DtypeKind.FP32), 4, 3))
    g = region.generation(2)
    region.begin_reuse(2)
    assert region.generation(2) == g + 1
    with pytest.raises(IndexError, match="not below num_blocks 3"):
        region.begin_reuse(3)


def test_bad_input_raises_with_the_cpp_message():
    with pytest.raises(ValueError, match="block_size must be in 1..4096"):
        kvtier.KvRegion.create(PagedKvLayout(ModelShape(1, 1, 4, DtypeKind.FP32), 0, 3))
    with pytest.raises(ValueError, match="unknown dtype"):
        kvtier.parse_dtype_kind("float64")
    with pytest.raises(ValueError, match="ambiguous"):
        kvtier.dtype_kind_of(torch.uint8)
    assert kvtier.dtype_kind_of(torch.bfloat16) == DtypeKind.BF16
    o = kvtier.ConnectorOptions()
    with pytest.raises(ValueError, match="socket_path is empty"):
        kvtier.Connector(o)
    o.socket_path = "/nonexistent/kvtier.sock"
    o.model_name = "m"
    o.scheduler = False
    with pytest.raises(ValueError, match="scheduler"):
        kvtier.Connector(o)  # a worker's connector needs a region


def test_a_scheduler_connector_refuses_worker_calls_and_a_closed_one_refuses_all():
    o = kvtier.ConnectorOptions()
    o.socket_path = "/nonexistent/kvtier.sock"
    o.model_name = "m"
    o.scheduler = True
    o.model = ModelShape(2, 2, 16, DtypeKind.BF16)
    c = kvtier.Connector(o)
    assert not c.has_region
    with pytest.raises(kvtier.UsageError, match="no kv_region"):
        c.store_hashes("r", [1], 0, [0])
    with pytest.raises(kvtier.UsageError):
        c.retrieve_hashes("r", [1], 0, [0])
    # No server: the lookup answers 0 at once (degraded), never raises.
    c.lookup("r", list(range(600)))
    assert c.lookup_result("r") == 0
    c.close()
    assert c.closed
    with pytest.raises(kvtier.KvtierError, match="closed"):
        c.lookup_result("r")


def test_a_waiting_call_releases_the_gil():
    o = kvtier.ConnectorOptions()
    o.socket_path = "/nonexistent/kvtier.sock"
    o.model_name = "m"
    o.scheduler = True
    o.model = ModelShape(2, 2, 16, DtypeKind.BF16)
    c = kvtier.Connector(o)
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    try:
        before = len(ticks)
        assert c.wait_ready(0.5) is False  # blocks 0.5 s in C++ without a server
        during = len(ticks) - before
    finally:
        stop.set()
        t.join()
        c.close()
    # With the GIL held for 0.5 s the other thread could not have run at all.
    assert during > 10
