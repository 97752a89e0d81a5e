"""kvtier as SGLang's HiCache storage backend (kvtier.integrations.sglang.KVTierStorage),
driven as SGLang's cache controller drives a backend (replay/sglang.py: its host pool in
every layout, its page keys, its prefetch and backup call pattern) against a real
kvtier-server:

* each method of the interface, the zero-copy page API and the flat-page API, on every host
  pool layout (MHA: layer_first, page_first, page_first_direct, page_head; MLA: the first
  three); pages written from one layout read back exact into another of the same kind;
* the contract SGLang's threads need: failures are misses, never an exception or a None; the
  unimplemented v2 methods raise;
* keys that keep models, salts, dtypes and TP ranks apart; MLA written once, by TP rank 0;
* TP=2, each rank its own process, with the server SIGKILLed and restarted mid-run;
* the TinyDecoder's logits through the host pool and KVTierStorage equal a full recompute bit
  for bit (``RESULT sglang_logits_max_abs_diff=0``).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import kvtier

from kvtier.integrations import _sglang_standin as standin
from kvtier.integrations.sglang import KVTierStorage, SGLangStorageOptions, chunk_hash
from kvtier.integrations.sglang_layouts import POOL_DIMS, page_view
from kvtier_testing import DEADLINE_S, list_keys, wait_until
from replay.model import TinyDecoder
from replay.sglang import HiCacheModel, HostPool, backup, host_indices, page_keys, prefetch

PAGE = 4
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
HERE = Path(__file__).resolve().parent


def config(socket_path, rank=0, tp=1, mla=False, model="test-model", **extra):
    return standin.HiCacheStorageConfig(
        tp_rank=rank,
        tp_size=tp,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model,
        extra_config={"socket_path": str(socket_path), "interface_v1": 1, "ready_timeout_s": 10, **extra},
    )


def backend(socket_path, layout="layer_first", pages=40, mla=False, dtype=torch.float32, heads=2, **kw):
    storage = KVTierStorage(config(socket_path, mla=mla, **kw), {})
    pool = HostPool(layout, 3, pages, PAGE, head_num=heads, head_dim=8, dtype=dtype, mla=mla)
    storage.register_mem_pool_host(pool)
    return storage, pool


def prompt(n_pages: int, seed: int) -> List[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n_pages * PAGE)]


def fill_random(pool: HostPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.dtype))


@pytest.fixture
def server(servers):
    return servers.start(chunk_tokens=PAGE, slot_bytes=4096, l1_mb=16)


# -- the host pool stand-in and the layout description ------------------------------------------


@pytest.mark.parametrize("mla,layout", [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS])
def test_a_page_of_the_pool_view_is_exactly_the_bytes_sglang_hands_a_zero_copy_backend(mla, layout):
    pool = HostPool(layout, 3, 10, PAGE, head_num=2, head_dim=8, mla=mla)
    pages = page_view(pool.kv_buffer, POOL_DIMS[("mla" if mla else "mha", layout)], PAGE)
    e = pool.kv_buffer.element_size()
    flat = pool.kv_buffer.view(-1)
    for p in (0, 3, 9):
        flat.zero_()
        pages.tensor.select(pages.page_dim, p).fill_(1.0)
        ptrs, sizes = pool.get_page_buffer_meta(host_indices([p], PAGE))
        covered = 0
        for ptr, size in zip(ptrs, sizes):
            first = (ptr - pool.kv_buffer.data_ptr()) // e
            assert bool((flat[first : first + size // e] == 1.0).all()), (layout, p)
            covered += size // e
        assert covered == int((flat == 1.0).sum()), (layout, p)
        # and SGLang's flat page is the view's page in the pool's order
        assert torch.equal(pool.get_data_page(p * PAGE), pages.tensor.select(pages.page_dim, p).reshape(-1))


def test_the_backend_subclasses_the_base_sglang_checks_and_is_built_as_the_factory_builds_it(server):
    assert issubclass(KVTierStorage, standin.load_hicache_base().HiCacheStorage)
    storage, _ = backend(server.socket_path)
    try:
        assert storage.worker.healthy
    finally:
        storage.close()


# -- each method, each layout -------------------------------------------------------------------


@pytest.mark.parametrize("mla,layouts", [(False, MHA_LAYOUTS[:3]), (True, MLA_LAYOUTS)])
def test_pages_written_from_one_layout_read_back_exact_into_every_layout_of_the_kind(server, mla, layouts):
    keys = page_keys(prompt(150, 1), PAGE)  # two batches of SGLang's 128
    src, src_pool = backend(server.socket_path, layouts[0], pages=150, mla=mla)
    fill_random(src_pool, 1)
    assert src.batch_exists(keys) == 0
    assert backup(src, keys, list(range(150)), PAGE) == 150
    for layout in layouts:
        dst, pool = backend(server.socket_path, layout, pages=160, mla=mla)
        try:
            assert dst.batch_exists(keys) == 150
            where = list(range(10, 160))  # other pages than the writer's
            assert prefetch(dst, keys, where, PAGE) == 150
            for i, p in enumerate(where):
                for layer in range(3):
                    assert torch.equal(pool.page_kv(p, layer), src_pool.page_kv(i, layer)), (layout, i, layer)
            assert dst.kvtier_stats()["get_hits"] == 150
        finally:
            dst.close()
    src.close()


def test_page_head_keeps_heads_outside_tokens_and_round_trips_in_its_own_namespace(server):
    keys = page_keys(prompt(20, 2), PAGE)
    a, pa = backend(server.socket_path, "page_head", pages=20)
    fill_random(pa, 2)
    assert backup(a, keys, list(range(20)), PAGE) == 20
    b, pb = backend(server.socket_path, "page_head", pages=20)
    nhd, _ = backend(server.socket_path, "layer_first", pages=20)
    assert prefetch(b, keys, list(range(20)), PAGE) == 20
    assert torch.equal(pa.kv_buffer, pb.kv_buffer)
    assert nhd.batch_exists(keys) == 0  # HND chunk objects are another model id than NHD ones
    for s in (a, b, nhd):
        s.close()


def test_batch_exists_counts_the_leading_stored_pages_only(server):
    storage, pool = backend(server.socket_path, pages=20)
    keys = page_keys(prompt(20, 3), PAGE)
    fill_random(pool, 3)
    assert backup(storage, keys[:8], list(range(8)), PAGE) == 8
    assert backup(storage, keys[10:14], list(range(10, 14)), PAGE) == 4
    assert storage.batch_exists(keys) == 8
    assert storage.batch_exists(keys[10:]) == 4
    assert storage.batch_exists([]) == 0
    assert storage.exists(keys[0]) and not storage.exists(keys[9])
    # batch_get_v1: True up to the first page not stored, False from there
    got = storage.batch_get_v1(keys[:12], host_indices(list(range(12)), PAGE), None)
    assert got == [True] * 8 + [False] * 4
    storage.close()


def test_the_flat_page_api_moves_sglangs_flat_pages(server):
    storage, pool = backend(server.socket_path, "page_first", pages=10)
    fill_random(pool, 4)
    keys = page_keys(prompt(10, 4), PAGE)
    values = [pool.get_data_page(i * PAGE) for i in range(10)]
    assert storage.batch_set(keys[:9], values[:9])
    assert storage.set(keys[9], values[9])
    assert storage.exists(keys[9])
    targets = [pool.get_dummy_flat_data_page() for _ in range(10)]
    got = storage.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(t, v) for t, v in zip(targets, values))
    one = storage.get(keys[3])
    assert torch.equal(one, values[3])
    other = page_keys(prompt(2, 99), PAGE)
    assert storage.get(other[0]) is None
    assert storage.batch_get([keys[0], other[0], keys[1]]) [1:] == [None, None]
    assert storage.batch_set(other, [values[0]]) is False  # one value for two keys: refused, not raised
    storage.close()


def test_the_unimplemented_v2_methods_raise_as_upstreams_defaults_do(server):
    storage, _ = backend(server.socket_path)
    for call in (
        lambda: storage.batch_exists_v2(["k"]),
        lambda: storage.batch_get_v2([]),
        lambda: storage.batch_set_v2([]),
    ):
        with pytest.raises(NotImplementedError):
            call()
    assert storage.get_stats() is None  # upstream's default: SGLang's metrics then skip L3
    storage.clear()  # a no-op that says so
    storage.close()


# -- failures are misses ------------------------------------------------------------------------


def test_failures_are_misses_never_exceptions_nor_none(server, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "kvtier")
    keys = page_keys(prompt(6, 5), PAGE)
    # no server at all: constructed, registered, answers misses
    lonely = KVTierStorage(config(tmp_path / "nobody.sock", ready_timeout_s=0.2), {})
    lonely.register_mem_pool_host(HostPool("layer_first", 3, 6, PAGE, head_num=2))
    assert lonely.batch_exists(keys) == 0
    assert lonely.batch_get_v1(keys, host_indices(list(range(6)), PAGE)) == [False] * 6
    assert lonely.batch_set_v1(keys, host_indices(list(range(6)), PAGE)) == [False] * 6
    assert lonely.batch_get(keys) == [None] * 6
    assert lonely.batch_set(keys, [torch.zeros(1)] * 6) is False
    lonely.close()
    storage, pool = backend(server.socket_path, pages=6)
    # malformed calls: misses, logged
    assert storage.batch_set_v1(keys, torch.tensor([1, 2, 3]), None) == [False] * 6
    assert storage.batch_get_v1(keys, host_indices([0, 1, 2, 3, 4, 99], PAGE), None) == [False] * 6
    assert storage.batch_set_v1(keys[:2], torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), None) == [False] * 2  # unaligned
    assert storage.kvtier_stats()["failures"] == 3
    assert "answered as misses" in caplog.text
    # the server dies: misses; it comes back: hits again
    fill_random(pool, 5)
    assert backup(storage, keys, list(range(6)), PAGE) == 6
    server.kill()
    wait_until(lambda: not storage.worker.healthy, what="the connector to see the server gone")
    assert storage.batch_exists(keys) == 0
    assert storage.batch_get_v1(keys, host_indices(list(range(6)), PAGE)) == [False] * 6
    assert storage.batch_set_v1(keys, host_indices(list(range(6)), PAGE)) == [False] * 6
    server.start()
    wait_until(lambda: storage.worker.healthy and storage.scheduler.healthy, what="the reconnection")
    assert storage.batch_exists(keys) == 0  # a new server's memory is empty
    assert backup(storage, keys, list(range(6)), PAGE) == 6
    assert prefetch(storage, keys, list(range(6)), PAGE) == 6
    storage.close()


def test_a_hung_server_costs_misses_and_its_late_copies_never_reach_the_pool(server):
    storage, pool = backend(
        server.socket_path, pages=8, timeouts_ms={"lookup_timeout_ms": 300, "retrieve_timeout_ms": 300,
                                                  "store_timeout_ms": 300, "request_timeout_ms": 300}
    )
    keys = page_keys(prompt(8, 6), PAGE)
    fill_random(pool, 6)
    assert backup(storage, keys, list(range(8)), PAGE) == 8
    before = pool.kv_buffer.clone()
    server.pause()
    try:
        assert storage.batch_get_v1(keys, host_indices(list(range(8)), PAGE)) == [False] * 8
        assert storage.batch_set_v1(keys, host_indices(list(range(8)), PAGE)) == [False] * 8
    finally:
        server.resume()
    assert torch.equal(pool.kv_buffer, before)  # nothing the hung server did reached the pool
    wait_until(lambda: storage.batch_exists(keys) == 8, what="hits after the server resumed")
    storage.close()


# -- keys ------------------------------------------------------------------------------------------


def test_keys_keep_models_salts_dtypes_and_layout_kinds_apart(server):
    keys = page_keys(prompt(5, 7), PAGE)
    writer, pool = backend(server.socket_path, pages=5)
    fill_random(pool, 7)
    assert backup(writer, keys, list(range(5)), PAGE) == 5
    same, _ = backend(server.socket_path, "page_first", pages=5)
    assert same.batch_exists(keys) == 5
    others = [
        backend(server.socket_path, pages=5, model="another-model")[0],
        backend(server.socket_path, pages=5, cache_salt="tenant-b")[0],
        backend(server.socket_path, pages=5, dtype=torch.float16)[0],
        backend(server.socket_path, pages=5, heads=4)[0],
        backend(server.socket_path, pages=5, mla=True)[0],
    ]
    assert [o.batch_exists(keys) == 0 for o in others] == [True] * len(others)
    for s in [writer, same, *others]:
        s.close()


def test_chunk_hashes_come_from_sglangs_sha256_keys_and_any_other_string():
    key = page_keys(prompt(1, 8), PAGE)[0]
    assert chunk_hash(key) == int(key[:32], 16)
    assert chunk_hash("not-a-digest") == chunk_hash("not-a-digest") != chunk_hash("not-a-digest2")
    assert 0 <= chunk_hash("x") < 1 << 128


def test_options_are_checked_and_named(tmp_path, caplog):
    with pytest.raises(ValueError, match="socket"):
        SGLangStorageOptions.from_extra_config({}, "m")
    with pytest.raises(ValueError, match="model_name"):
        SGLangStorageOptions.from_extra_config({"socket_path": "/x"}, None)
    with pytest.raises(ValueError, match="unknown timeout"):
        SGLangStorageOptions.from_extra_config({"socket_path": "/x", "timeouts_ms": {"nap_ms": 1}}, "m")
    o = SGLangStorageOptions.from_extra_config({"socket_path": "/x", "lookup_timeout_ms": 7, "backend_name": "kvtier"}, "m")
    assert o.timeouts_ms == {"lookup_timeout_ms": 7}
    caplog.set_level(logging.WARNING, "kvtier")
    SGLangStorageOptions.from_extra_config({"socket_path": "/x", "sokcet_path": "/y"}, "m")
    assert "sokcet_path" in caplog.text
    with pytest.raises(ValueError, match="layout"):
        s = KVTierStorage(config(tmp_path / "s.sock", ready_timeout_s=0), {})
        s.register_mem_pool_host(type("P", (), {"layout": "page_first_kv_split", "page_size": 4, "kv_buffer": None})())


# -- TP ranks in their own processes, with the server killed and restarted ------------------------


class Rank:
    """One TP rank of the controller replay (replay/sglang.py), its JSON lines collected."""

    def __init__(self, spec: Dict, log: Path) -> None:
        self.lines: List[Dict] = []
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "replay" / "sglang.py"), json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    def rounds(self) -> List[Dict]:
        return [x for x in list(self.lines) if "round" in x]

    def finish(self) -> Dict:
        self.proc.wait(timeout=DEADLINE_S)
        self._reader.join(timeout=DEADLINE_S)
        assert self.proc.returncode == 0, self.log.read_text(errors="replace")[-3000:]
        return self.lines[-1]


def wait_rounds(ranks: List[Rank], done, what: str) -> None:
    """Waits until ``done(rank)`` holds for every rank; fails naming each rank's last round
    and log."""
    try:
        wait_until(lambda: all(done(r) for r in ranks), 120, what, poll_s=0.05)
    except AssertionError as e:
        detail = [(r.rounds()[-1:], r.proc.poll(), r.log.read_text(errors="replace")[-800:]) for r in ranks]
        raise AssertionError(f"{e}: {detail}") from None


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_tp2_ranks_in_separate_processes_survive_the_server_killed_and_restarted(server, tmp_path, mla):
    stop = tmp_path / "stop"
    specs = [
        {"rank": r, "tp": 2, "mla": mla, "page_size": PAGE, "layout": "page_first" if r else "layer_first",
         "socket": str(server.socket_path), "pages": 150, "prompts": 3, "stop_file": str(stop),
         "build_python": str(Path(kvtier.__file__).parents[1]),
         "extra": {"lookup_timeout_ms": 2000, "retrieve_timeout_ms": 2000, "store_timeout_ms": 2000}}
        for r in range(2)
    ]
    ranks = [Rank(s, tmp_path / f"rank{i}.log") for i, s in enumerate(specs)]
    try:
        # Phase 1: hits on every rank (the prompts come round again after their first backup).
        wait_rounds(ranks, lambda r: any(x["hit"] == 150 for x in r.rounds()), "hits before the kill")
        if mla:  # one object per chunk, TP rank 0's: rank 1 wrote nothing and reads it
            keys = list_keys(server.socket_path, "l1")
            assert {k["world_size"] for k in keys} == {1} and len(keys) == 3 * 150
        server.kill()
        marks = [len(r.rounds()) for r in ranks]
        wait_rounds(ranks, lambda r: len(r.rounds()) >= marks[ranks.index(r)] + 3, "rounds while down")
        down = [r.rounds()[m + 1 :] for r, m in zip(ranks, marks)]
        assert all(x["hit"] == 0 for rounds in down for x in rounds[1:])
        server.start()
        marks = [len(r.rounds()) for r in ranks]
        wait_rounds(
            ranks, lambda r: any(x["hit"] == 150 for x in r.rounds()[marks[ranks.index(r)] :]), "hits after the restart"
        )
    finally:
        stop.touch()
    ends = [r.finish() for r in ranks]
    for r in ranks:
        rounds = r.rounds()
        assert all(not x["errors"] for x in rounds), rounds[-1]["errors"]
        assert sum(x["wrong"] for x in rounds) == 0
    assert all(e["done"] and e["stats"]["failures"] == 0 for e in ends), ends


# -- the TinyDecoder through a HiCache-like host pool ---------------------------------------------


def test_tiny_decoder_logits_through_kvtier_storage_equal_a_full_recompute_bit_for_bit(server, capsys):
    model = TinyDecoder()
    prompts = [prompt(0, 0) + [(i * 13 + 5) % 101 for i in range(45)], [(i * 17 + 2) % 101 for i in range(61)]]
    prompts.append(prompts[0][:40] + [7, 8, 9, 10, 11, 12, 13])  # shares 10 pages with the first
    want = [HiCacheModel(model, HostPool("layer_first", 3, 20, PAGE, 2, 8), None).run(p)[0] for p in prompts]
    diff, hits = 0.0, 0
    for i, (a_layout, b_layout) in enumerate(zip(MHA_LAYOUTS, MHA_LAYOUTS[1:] + MHA_LAYOUTS[:1])):
        salt = f"case{i}"  # each case starts from an empty namespace
        sa, pa = backend(server.socket_path, a_layout, pages=20, cache_salt=salt)
        sb, pb = backend(server.socket_path, b_layout, pages=20, cache_salt=salt)
        first = HiCacheModel(model, pa, sa)
        second = HiCacheModel(model, pb, sb)
        logits, hit = first.run(prompts[0])
        assert hit == 0 and torch.equal(logits, want[0])
        first.run(prompts[1])
        same_kind = (a_layout == "page_head") == (b_layout == "page_head")
        for p, w in zip(prompts, want):
            logits, hit = second.run(p)
            diff = max(diff, float((logits - w).abs().max()))
            hits += hit
            if same_kind:
                assert hit == min((len(p) - 1) // PAGE, 10 if p is prompts[2] else 99), (a_layout, b_layout)
        sa.close()
        sb.close()
    assert diff == 0.0
    assert hits > 0
    with capsys.disabled():
        print()
        print(f"RESULT sglang_logits_max_abs_diff={diff:g}")
        print(f"RESULT sglang_hit_pages={hits}")


def test_a_server_of_another_chunk_size_costs_misses_and_says_why(servers):
    other = servers.start(chunk_tokens=16, name="chunk16")
    storage = KVTierStorage(config(other.socket_path, ready_timeout_s=1), {})
    storage.register_mem_pool_host(HostPool("layer_first", 3, 8, PAGE, head_num=2))
    keys = page_keys(prompt(2, 9), PAGE)
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys, host_indices([0, 1], PAGE)) == [False, False]
    assert "chunk_tokens=16" in storage.worker.last_error
    storage.close()
