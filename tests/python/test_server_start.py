"""A restarted kvtier-server serves its engines at once (docs/server.md, "Start-up"): it
listens before it faults L1 in, and the disk L2 answers from the first lookup. Three
kill/restart cycles with a worker and a scheduler reconnecting each time: every round, the
last one included, hits on the disk and loads the exact bytes, and at least one round is
served while the new server's L1 is still being faulted in (before, a server faulted all of
L1 in before it listened: 0.5-1.1 s deaf per GiB, and kills 0.7 s apart left the last round
with no hits at all)."""

from __future__ import annotations

import json

import torch

import kvtier
from kvtier import DtypeKind, ModelShape, PagedKvLayout
from kvtier_testing import finished, options, wait_until

CT = 16  # chunk tokens
BS = 4  # block size
SHAPE = ModelShape(2, 2, 8, DtypeKind.FP32)  # 4 KiB chunk objects
CHUNKS = 4
#: L1 of the restarted servers: large enough that faulting it in (~0.35-4 s per GiB on the
#: dev VM) outlasts a reconnect and a round (~0.1-0.3 s), small enough for a CI machine.
L1_MB = 2048


def reconnected(conns, token):
    wait_until(lambda: all(c.healthy and c.boot_token == token for c in conns), what="the connectors reconnected")


def test_engines_hit_the_disk_in_every_round_of_three_kill_restart_cycles(servers, tmp_path):
    disk = json.dumps({"type": "disk", "path": str(tmp_path / "l2"), "capacity_gb": 0.0625})
    srv = servers.start(chunk_tokens=CT, l1_mb=L1_MB, extra=["--l2-backend", disk], name="restarted")
    region = kvtier.KvRegion.create(PagedKvLayout(SHAPE, BS, 64))
    # One engine across its two connections, as vLLM's scheduler and worker are (the same
    # engine_id): the worker's retrieve then copies through the scheduler's lookup as its
    # loads land. Without it each connection is an engine of its own, the retrieve takes the
    # plain pin path and a chunk still loading from the disk is a load error (on the loaded
    # CI VM, every block of a round after a restart).
    w_opts = options(srv.socket_path, chunk_tokens=CT, scheduler=False)
    w_opts.engine_id = "restarted-engine"
    w = kvtier.Connector(w_opts, region)
    o = options(srv.socket_path, chunk_tokens=CT, scheduler=True)
    o.engine_id = "restarted-engine"
    o.model = SHAPE
    sched = kvtier.Connector(o)
    assert w.wait_ready(30) and sched.wait_ready(30), w.last_error + sched.last_error

    layers = kvtier.torch_layers(region)
    torch.manual_seed(3)
    for t in layers:
        t.copy_(torch.randn_like(t))
    tokens = list(range(500, 500 + CHUNKS * CT + 3))
    stored = list(range(CHUNKS * CT // BS))
    w.store("fill", tokens, 0, CHUNKS, stored)
    finished(w, "fill", "sending", ["fill"])
    wait_until(lambda: srv.status()["backends"][0]["objects"] == CHUNKS, what="the chunks on the disk")
    expected = [t[:, stored].clone() for t in layers]

    residency = []
    for cycle in range(3):
        srv.restart()  # SIGKILL, then a new process on the same socket and disk
        token = srv.status()["boot_token"]
        reconnected([w, sched], token)
        rid = f"round-{cycle}"
        sched.lookup(rid, tokens)
        wait_until(lambda: sched.lookup_result(rid) is not None, what="the lookup's answer")
        assert sched.lookup_result(rid) == CHUNKS * CT, f"round {cycle}: no hit on the disk"
        into = list(range(63, 63 - len(stored), -1))
        for t in layers:
            t[:, into] = 0
        w.retrieve(rid, tokens, 0, into, skip_tokens=0)
        finished(w, rid, "recving")
        assert w.take_load_error_blocks() == [], (cycle, w.last_error, w.stats(), srv.status(), srv.log_text())
        for t, e in zip(layers, expected):
            assert torch.equal(t[:, into], e), f"round {cycle}: wrong bytes"
        sched.end_request(rid)
        residency.append(srv.status()["l1"].get("residency"))
    # The rounds were served behind the L1 prefault, not after it.
    assert "faulting" in residency, residency
    for c in (w, sched):
        c.close()
