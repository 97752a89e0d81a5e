"""The soak's main loop: start everything, step the engines, inject the faults the schedule
draws, sample the server, and stop at quiet points to check the invariants."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import time
from pathlib import Path
from typing import List, Optional

import kvtier
from kvtier_testing import FAST_TIMEOUTS_MS, ServerProcess, status as socket_status

from . import invariants as inv
from .faults import FaultSchedule
from .processes import DiskDir, MiniEngine, RedisProcess, fd_kinds, open_fds, resident_set
from .report import Record, Sample, growth_per_hour, pct_per_hour, svg, table, write_json
from .workload import EngineSpec, PromptPool, ReplayDriver

CHUNK_TOKENS = 16
ENGINES = (
    EngineSpec("tp2-nhd", world_size=2, layout="NHD", block_size=4, num_blocks=1024, salts=("", "tenant-a")),
    EngineSpec("tp1-hnd", world_size=1, layout="HND", block_size=8, num_blocks=512, dtype="float16", salts=("", "tenant-b", "tenant-c")),
)


class Soak:
    def __init__(self, args, out: Path) -> None:
        self.a = args
        self.out = out
        self.rng = random.Random(args.seed)  # the faults: their kinds, times and details
        self.mini_rng = random.Random(args.seed * 31 + 5)  # the mini engine's jobs
        self.record = Record(args.seed, args.duration)
        self.t0 = time.monotonic()
        self.boot = 0
        self.redis: Optional[RedisProcess] = None
        self.disk: Optional[DiskDir] = None
        self.server: Optional[ServerProcess] = None
        self.mini: Optional[MiniEngine] = None
        self.drivers: List[ReplayDriver] = []
        self.quiet_points = 0
        self.fd_base = {}  # boot -> descriptors not owed to a connection or a registration, fewest seen at its quiet points (the first, or a later lower count)
        self.metrics_url = ""
        dur = args.duration
        self.quiet_every = args.quiet_every or min(300.0, max(20.0, dur / 3))
        self.schedule = FaultSchedule(self.rng, args.fault_every or (4.0 if dur < 300 else 15.0), dur,
                                      dur * args.server_faults_until, kinds=tuple(args.faults.split(",")) if args.faults else ())

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- start and stop --------------------------------------------------------------------
    def start(self) -> None:
        build = self.a.build_dir
        redis_bin = shutil.which("redis-server")
        if redis_bin is None:
            raise RuntimeError("no redis-server on PATH (Debian: redis-server)")
        self.redis = RedisProcess(redis_bin, self.out)
        self.disk = DiskDir(self.out, size_mb=48)
        if not self.disk.mounted:
            self.schedule.unavailable = ("disk_full",)
            print("kvtier_soak: no tmpfs of its own (not root, or mount refused): the full-disk fault is left out", flush=True)
        disk = {"type": "disk", "name": "disk", "path": str(self.disk.path), "capacity_bytes": 40 << 20, "o_direct": False}
        redis = {"type": "redis", "name": "redis", "nodes": [f"127.0.0.1:{self.redis.port}"], "key_prefix": "soak:"}
        args = ["--chunk-size", str(CHUNK_TOKENS), "--l1-slot-bytes", str(16 << 10), "--l1-size-mb", "8",
                "--metrics-port", "auto", "--log-level", "warn", "--client-reap-timeout", "10",
                "--l2-backend", json.dumps(disk), "--l2-backend", json.dumps(redis)]
        self.server = ServerProcess(build / "examples" / "kvtier-server", self.out / "server.sock", args, self.out / "server.log")
        self._booted()
        pool = PromptPool(random.Random(self.a.seed * 7919 + 1))
        timeouts = dict(FAST_TIMEOUTS_MS)
        for spec in ENGINES:
            self.drivers.append(ReplayDriver(spec, str(self.server.socket_path), random.Random(f"{self.a.seed}/{spec.name}"), pool,
                                             CHUNK_TOKENS, timeouts))
        self.mini = MiniEngine(build / "examples" / "kvtier_mini_engine", self.server.socket_path, self.out, CHUNK_TOKENS)

    def _booted(self) -> None:
        self.boot += 1
        self.metrics_url = socket_status(self.server.socket_path)["metrics_url"]

    def close(self) -> None:
        for d in self.drivers:
            try:
                d.close()
            except Exception:
                pass
        if self.mini is not None:
            self.mini.kill()
        if self.server is not None:
            self.server.terminate()
        if self.redis is not None:
            self.redis.kill()
        if self.disk is not None:
            self.disk.close()

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        next_quiet = self.quiet_every
        next_sample = 0.0
        while self.now() < self.a.duration:
            now = self.now()
            self.schedule.end_due(now)
            kind = self.schedule.draw(now)
            if kind is not None:
                try:
                    self.inject(kind)
                except OSError as e:  # the soak's own tools (a file, a process): said, and the run goes on
                    print(f"[{now:8.1f} s] could not inject {kind}: {e}", flush=True)
            for d in self.drivers:
                d.tick(admit=True)
                self._take_failures(d)
            self._mini_tick(start=True)
            if now >= next_sample:
                self.sample(quiet=False)
                next_sample = now + self.a.sample_every
            if now >= next_quiet:
                self.quiet_point()
                next_quiet = self.now() + self.quiet_every
            if self.a.stop_on_failure and self.record.failures:
                return
        self.quiet_point()

    def _take_failures(self, d: ReplayDriver) -> None:
        for f in d.failures:
            self.record.fail(self.now(), _engine_invariant(f), f)
        d.failures.clear()

    def _mini_tick(self, start: bool) -> None:
        res = self.mini.poll()
        if res:
            self.record.fail(self.now(), _engine_invariant(res), res)
        if start and not self.mini.running():
            self.mini.start(self.mini_rng)

    # --- faults -----------------------------------------------------------------------------
    def inject(self, kind: str) -> None:
        now, r, s = self.now(), self.rng, self.schedule
        if kind in ("server_kill", "server_restart"):
            s.end_due(now, everything=True)  # a stopped server is resumed first (a restart needs it alive)
            if kind == "server_kill":
                self.server.kill()
            else:
                self.server.terminate()
            self.server.start()
            self._booted()
            s.record(now, kind, f"boot {self.boot}")
        elif kind == "server_stop":
            self.server.pause()
            s.record(now, kind, "", r.uniform(0.5, 4.0), self.server.resume)
        elif kind == "engine_kill":
            if self.mini.running() and r.random() < 0.4:
                self.mini.kill()
                s.record(now, kind, "mini engine")
            else:
                d = r.choice(self.drivers)
                d.arm_kill()
                s.record(now, kind, f"{d.spec.name}: a worker in its next loading step")
        elif kind == "client_disconnect":
            s.record(now, kind, self._raw_client(r))
        elif kind in ("disk_corrupt", "disk_delete"):
            files = self.disk.object_files()
            picked = r.sample(files, min(len(files), r.randint(1, 4)))
            for f in picked:
                try:
                    if kind == "disk_delete":
                        f.unlink()
                    else:
                        size = f.stat().st_size
                        with open(f, "r+b") as fh:
                            fh.seek(r.randrange(max(size, 1)))
                            b = fh.read(1)
                            fh.seek(-len(b), os.SEEK_CUR)
                            fh.write(bytes([(b[0] if b else 0) ^ 0x5A]))
                except OSError:
                    pass
            s.record(now, kind, f"{len(picked)} objects")
        elif kind == "disk_full":
            taken = self.disk.fill()
            s.record(now, kind, f"{taken >> 20} MiB filler", r.uniform(2.0, 8.0), self.disk.unfill)
        elif kind == "redis_restart":
            self.redis.kill()
            s.record(now, kind, "", r.uniform(0.2, 2.0), self.redis.start)
        elif kind == "redis_stop":
            self.redis.pause()
            s.record(now, kind, "", r.uniform(0.5, 4.0), self.redis.resume)

    def _raw_client(self, r: random.Random) -> str:
        """A client that leaves at some point of a request's life (docs/protocol.md frames)."""
        header = struct.Struct("<4sHHQI")
        status_req = header.pack(b"KVT1", kvtier.PROTOCOL_VERSION, 0x000C, 1, 0)
        how = r.choice(["connect_close", "half_header", "header_then_short_body", "request_then_close", "garbage"])
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(2)
                c.connect(str(self.server.socket_path))
                if how == "half_header":
                    c.sendall(status_req[:7])
                elif how == "header_then_short_body":
                    c.sendall(header.pack(b"KVT1", kvtier.PROTOCOL_VERSION, 0x000C, 2, 4096) + b"\x01" * 100)
                elif how == "request_then_close":
                    c.sendall(status_req)
                elif how == "garbage":
                    c.sendall(bytes(r.randrange(256) for _ in range(64)))
        except OSError as e:
            return f"{how} ({e})"
        return how

    # --- samples and quiet points ----------------------------------------------------------
    def sample(self, quiet: bool) -> Optional[Sample]:
        try:
            st = inv.status(self.metrics_url)
            m = inv.scrape(self.metrics_url)
        except OSError:
            return None  # a stopped server: no sample now
        pid = self.server.pid
        regs = sum(1 for c in st.get("clients", []) if c.get("registered"))
        mem = st.get("memory") or {}
        rss = resident_set(pid) or {}
        smp = Sample(round(self.now(), 1), self.boot, rss.get("rss", 0), rss.get("anon", 0), rss.get("shmem", 0),
                     mem.get("heap_in_use_bytes", 0) // 1024,
                     mem.get("heap_free_bytes", 0) // 1024, open_fds(pid) or 0, st.get("connections", 0), regs,
                     inv.total(m, "kvtier_lookup_hit_tokens_total"), inv.total(m, "kvtier_lookup_requested_tokens_total"), quiet)
        self.record.samples.append(smp)
        return smp

    def quiet_point(self) -> None:
        t = self.now()
        self.quiet_points += 1
        self.schedule.end_due(t, everything=True)
        res = self.mini.wait(300)
        if res:
            self.record.fail(self.now(), _engine_invariant(res), res)
        for d in self.drivers:
            try:
                d.drain(timeout_s=300)
            except AssertionError as e:  # what vLLM would have died of: said, and a fresh engine goes on
                v = d.engine.violations
                self.record.fail(self.now(), "engine_drains", f"{d.spec.name}: {v[-1] if v else e}")
                d.restart()
            self._take_failures(d)
        deadline = time.monotonic() + 60
        while not all(d.healthy() for d in self.drivers) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not all(d.healthy() for d in self.drivers):
            self.record.fail(self.now(), "engines_reconnect", "an engine's connection is not healthy 60 s after the faults ended")
        held, st, m = self._wait_server_idle(60)
        if held:
            self.record.fail(self.now(), "server_idle", "; ".join(held))
        for b in inv.books(m):
            self.record.fail(self.now(), "books", b)
        for d in self.drivers:
            bad = self._engine_held(d, 10.0)
            if bad:
                self.record.fail(self.now(), "engine_idle", f"{d.spec.name}: {bad}")
        self._wait_heap_given_back(15.0)
        smp = self.sample(quiet=True)
        if smp is not None:
            self._check_fds()
        print(f"[{self.now():8.1f} s] quiet point {self.quiet_points}: boot {self.boot}, "
              f"rss {smp.rss_kib if smp else '?'} KiB, fds {smp.fds if smp else '?'}, "
              f"{sum(d.finished for d in self.drivers)} replay requests, {self.mini.ok} mini jobs ok, "
              f"{len(self.schedule.injected)} faults, {len(self.record.failures)} broken", flush=True)

    def _wait_heap_given_back(self, timeout_s: float) -> None:
        """An idle server gives its heap's free pages back within 10 s (its reaper's trim:
        docs/server.md, "Memory"); the quiet point's memory sample waits for that trim, so that
        every quiet point measures the same thing (what an idle server holds), not whether a
        trim happened to come before it. Nothing to wait for where the heap holds less than
        the trim's threshold free, or where the server does not report its heap."""
        try:
            mem = inv.status(self.metrics_url).get("memory") or {}
        except OSError:
            return
        if "heap_trims" not in mem or mem.get("heap_free_bytes", 0) <= 4 << 20:
            return
        trims = mem["heap_trims"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                if (inv.status(self.metrics_url).get("memory") or {}).get("heap_trims", trims) > trims:
                    return
            except OSError:
                return

    def _check_fds(self) -> None:
        """The server's descriptors at a quiet point: those that are not sockets, and its
        sockets beside its connections, no more than at the boot's first quiet point once the
        HTTP connections of this very check have closed (polled for 5 s). Fewer is no leak: a
        socket of a fault that was still closing (a Redis reconnection, a raw client) may have
        been counted at the first quiet point; the lower count becomes the boot's base."""
        deadline = time.monotonic() + 5
        while True:
            kinds = fd_kinds(self.server.pid)
            conns = inv.status(self.metrics_url).get("connections", 0)
            now = {"files": sum(v for k, v in kinds.items() if k != "socket"), "sockets_beside_connections": kinds.get("socket", 0) - conns}
            if self.boot not in self.fd_base:
                print(f"[{self.now():8.1f} s] boot {self.boot}: server descriptors at its first quiet point: {kinds}, "
                      f"{conns} connections", flush=True)
            first, first_kinds = self.fd_base.setdefault(self.boot, (now, kinds))
            if all(now[k] <= first[k] for k in now):
                if now != first:
                    self.fd_base[self.boot] = (now, kinds)
                return
            if time.monotonic() > deadline:
                grown = {k: v - first_kinds.get(k, 0) for k, v in kinds.items() if v != first_kinds.get(k, 0)}
                self.record.fail(self.now(), "server_fds", f"boot {self.boot}: {now} at this quiet point, {first} at the "
                                 f"boot's first; by kind: {grown}")
                return
            time.sleep(0.1)

    @staticmethod
    def _engine_held(d: ReplayDriver, timeout_s: float) -> dict:
        """What the engine still holds, polled for ``timeout_s`` (a ping may be in flight)."""
        deadline = time.monotonic() + timeout_s
        while True:
            bad = {k: v for k, v in d.idle_state().items() if v}
            if not bad or time.monotonic() > deadline:
                return bad
            time.sleep(0.1)

    def _wait_server_idle(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            st = inv.status(self.metrics_url)
            m = inv.scrape(self.metrics_url)
            held = inv.held_now(st, m)
            if not held or time.monotonic() > deadline:
                return held, st, m
            time.sleep(0.1)

    def replay_flags(self) -> str:
        """The flags that replay this run: seed, duration and every option that shapes the
        schedule (where and how much it writes does not)."""
        a = self.a
        flags = [f"--seed {a.seed}", f"--duration {a.duration:g}"]
        for name in ("quiet_every", "fault_every", "sample_every"):
            if getattr(a, name) is not None and name in self.a.explicit:
                flags.append(f"--{name.replace('_', '-')} {getattr(a, name):g}")
        if "server_faults_until" in self.a.explicit:
            flags.append(f"--server-faults-until {a.server_faults_until:g}")
        if a.faults:
            flags.append(f"--faults {a.faults}")
        return " ".join(flags)

    # --- the end ------------------------------------------------------------------------------
    def summarize(self) -> int:
        rec, sched = self.record, self.schedule
        rec.write_csv(self.out / "samples.csv")
        with open(self.out / "faults.csv", "w") as f:
            f.write("t,kind,detail\n")
            for x in sched.injected:
                f.write(f"{x.t:.1f},{x.kind},{x.detail}\n")
        measured_from = self.a.duration * self.a.server_faults_until
        last_boot = [s for s in rec.samples if s.boot == self.boot and s.t >= measured_from]
        warm = [s for s in last_boot if s.t >= measured_from + min(600.0, 0.1 * self.a.duration)]
        # The bound is on the server's own memory, RssAnon (heap, stacks, L1): its RSS also holds
        # the pages of the engines' KV regions it copied (RssShmem), which are the engines'
        # memory, bounded by their regions, and come and go as engines restart.
        def growth(value) -> Optional[float]:
            return growth_per_hour([(s.t, value(s)) for s in warm if s.quiet] or [(s.t, value(s)) for s in warm])

        own = growth(lambda s: s.rss_anon_kib or s.rss_kib)
        rss_growth = growth(lambda s: s.rss_kib)
        heap_growth = growth(lambda s: s.heap_in_use_kib) if warm and warm[0].heap_in_use_kib else None
        if own is not None and own >= 0.02:
            rec.fail(self.now(), "server_rss", f"the server's own memory (RssAnon) grows {own * 100:.2f}% per hour in the measured run (bound 2%)")
        wrong = sum(1 for f in rec.failures if f.invariant == "engine_kv")
        contract = sum(1 for f in rec.failures if f.invariant in ("engine_contract", "engine_drains", "engines_reconnect"))
        leaks = sum(1 for f in rec.failures if f.invariant in ("server_idle", "engine_idle", "server_fds", "books", "server_rss"))
        hits = sum(s.hit_tokens for s in self._last_of_each_boot())
        req = sum(s.requested_tokens for s in self._last_of_each_boot())
        rows = [
            ("seed", self.a.seed), ("duration_s", round(self.now(), 1)), ("server boots", self.boot),
            ("quiet points", self.quiet_points),
            ("replay requests finished", sum(d.finished for d in self.drivers)),
            ("replay requests aborted / preempted", f"{sum(d.aborted for d in self.drivers)} / {sum(d.preempted for d in self.drivers)}"),
            ("replay engines killed and restarted", sum(d.killed for d in self.drivers)),
            ("mini engine jobs ok / killed", f"{self.mini.ok} / {self.mini.killed}"),
            ("mini engine requests (in jobs ok)", self.mini.requests),
            ("faults injected", len(sched.injected)),
        ] + [(f"  {k}", v) for k, v in sched.counts().items()] + [
            ("token hit rate (server, all boots)", f"{hits / req:.3f}" if req else "n/a"),
            ("server RSS first / last (MiB)", f"{rec.samples[0].rss_kib / 1024:.1f} / {rec.samples[-1].rss_kib / 1024:.1f}" if rec.samples else "n/a"),
            ("server RSS growth, measured run", pct_per_hour(rss_growth)),
            ("server own memory (RssAnon) growth, measured run (bound 2%)", pct_per_hour(own)),
            ("server heap in use growth, measured run", pct_per_hour(heap_growth)),
            ("wrong KV (engine checks failed)", wrong),
            ("engine contract breaks (vLLM would assert, a step failed)", contract),
            ("leaks and imbalances", leaks),
        ]
        print("\nkvtier_soak summary\n" + table(rows), flush=True)
        svg(rec.samples, [(x.t, x.kind) for x in sched.injected], self.out / "soak.svg",
            f"kvtier_soak seed {self.a.seed}: {self.now() / 3600:.2f} h, {len(sched.injected)} faults, {self.boot} server boots")
        write_json(self.out / "soak.json", {"summary": dict((str(k).strip(), v) for k, v in rows),
                                             "failures": [f.__dict__ for f in rec.failures]})
        served = sum(d.finished for d in self.drivers) + self.mini.requests
        results = {"soak_requests_served": served, "soak_faults_injected": len(sched.injected), "soak_wrong_kv": wrong,
                   "soak_engine_contract_breaks": contract,
                   "soak_leaks": leaks, "soak_broken_invariants": len(rec.failures),
                   "soak_token_hit_rate": round(hits / req, 4) if req else 0}
        if rss_growth is not None:
            results["soak_rss_growth_pct_per_hour"] = round(rss_growth * 100, 3)
        if own is not None:
            results["soak_rss_anon_growth_pct_per_hour"] = round(own * 100, 3)
        for k, v in results.items():
            print(f"RESULT {k}={v}")
        print(f"files: {self.out}", flush=True)
        if rec.failures:
            f = rec.failures[0]
            print(f"\nFIRST BROKEN: {f.invariant} at {f.t} s: {f.detail}\n"
                  f"replay: /usr/bin/python3 bench/soak/kvtier_soak.py {self.replay_flags()} (it broke {f.t} s in)", flush=True)
            return 1
        return 0

    def _last_of_each_boot(self) -> List[Sample]:
        last = {}
        for s in self.record.samples:
            last[s.boot] = s
        return list(last.values())


def _engine_invariant(message: str) -> str:
    """``engine_kv`` when an engine read KV that was not its own (a replay worker's row check,
    the mini engine's wrong outputs or corrupt rows), else ``engine_contract`` (what vLLM
    asserts, a failed step, a job that did not complete)."""
    wrong = "KV rows not their token's" in message or message.startswith("mini engine job failed with wrong KV")
    return "engine_kv" if wrong else "engine_contract"

