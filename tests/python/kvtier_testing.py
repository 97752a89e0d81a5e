"""Helpers of the kvtier Python tests: kvtier-server processes and a raw status client."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import kvtier

#: Seconds a test waits for something that happens at once on a healthy machine (a server
#: starting, a connector registering). Generous: the suite runs on busy 2-core machines.
DEADLINE_S = 30.0


def server_binary(build_dir: Path) -> Path:
    env = os.environ.get("KVTIER_SERVER")
    return Path(env) if env else build_dir / "examples" / "kvtier-server"


class ServerProcess:
    """One kvtier-server process on a Unix socket."""

    def __init__(self, binary: Path, socket_path: Path, args: Sequence[str], log_path: Path) -> None:
        self.binary = binary
        self.socket_path = socket_path
        self.args = list(args)
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.startup_line = ""
        self._drain: Optional[threading.Thread] = None
        self.start()

    def start(self) -> None:
        """Starts the process and waits for its startup line (printed once it listens)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(self.binary), "--socket", str(self.socket_path), *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + DEADLINE_S
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                self.proc.kill()
                raise RuntimeError(f"kvtier-server did not start in time: {self.log_text()}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"kvtier-server exited ({self.proc.wait()}): {self.log_text()}")
            line += chunk
        self.startup_line = line.decode(errors="replace").strip()
        out = self.proc.stdout

        def drain() -> None:  # keep the pipe from filling
            try:
                while out.read(4096):
                    pass
            except (OSError, ValueError):
                pass

        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.running():
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies too, but reap it promptly
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=DEADLINE_S)

    def pause(self) -> None:
        """SIGSTOP: the server hangs (its socket stays open and answers nothing)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def terminate(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> None:
        """Kills the process and starts a new one on the same socket (a new boot token)."""
        self.kill()
        self.start()

    def status(self) -> dict:
        """The server's status document (status_request over a fresh connection)."""
        return status(self.socket_path)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


class ServerFactory:
    """Starts servers in one temporary directory; close() stops them all."""

    def __init__(self, binary: Path, tmp: Path) -> None:
        self.binary = binary
        self.tmp = tmp
        self.servers: List[ServerProcess] = []

    def start(
        self,
        chunk_tokens: int = 16,
        slot_bytes: int = 1 << 16,
        l1_mb: int = 16,
        extra: Sequence[str] = (),
        name: Optional[str] = None,
    ) -> ServerProcess:
        name = name or f"server{len(self.servers)}"
        args = [
            "--chunk-size",
            str(chunk_tokens),
            "--l1-slot-bytes",
            str(slot_bytes),
            "--l1-size-mb",
            str(l1_mb),
            "--log-level",
            "warn",
            *extra,
        ]
        s = ServerProcess(self.binary, self.tmp / f"{name}.sock", args, self.tmp / f"{name}.log")
        self.servers.append(s)
        return s

    def close(self) -> None:
        for s in self.servers:
            s.terminate()


# --- a raw protocol client for status_request (docs/protocol.md) -------------------------

_MAGIC = b"KVT1"
_HEADER = struct.Struct("<4sHHQI")
_STATUS_REQUEST = 0x000C
_ERROR_RESPONSE = 0x8000


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buf += chunk
    return buf


def _json_call(socket_path: Path, request: int, body: bytes, what: str, timeout_s: float) -> dict:
    """Sends one request whose answer is a JSON document (a u32-length string) and returns it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(socket_path))
        s.sendall(_HEADER.pack(_MAGIC, kvtier.PROTOCOL_VERSION, request, 1, len(body)) + body)
        magic, _version, mtype, _call, length = _HEADER.unpack(_read_exact(s, _HEADER.size))
        assert magic == _MAGIC
        reply = _read_exact(s, length)
        if mtype == _ERROR_RESPONSE:
            code, n = struct.unpack_from("<II", reply)
            raise RuntimeError(f"{what} refused ({code}): {reply[8:8 + n].decode()}")
        assert mtype == request | 0x8000, hex(mtype)
        (n,) = struct.unpack_from("<I", reply)
        return json.loads(reply[4 : 4 + n])


def status(socket_path: Path, timeout_s: float = DEADLINE_S) -> dict:
    """The status JSON of the server on ``socket_path``."""
    return _json_call(socket_path, _STATUS_REQUEST, b"", "status", timeout_s)


def wait_l1_settled(socket_path: Path, timeout_s: float = 300.0, who: str = "kvtier") -> None:
    """Returns once the server on ``socket_path`` has faulted its L1 in and registered it
    (status ``l1.residency`` neither ``faulting`` nor ``registering``). A server does that
    behind its first requests, on the cores a benchmark's steps run on, for 1 s or more per
    GiB (0.3-6.5 s per 2 GiB in huge pages on the dev VM, the kernel compacting memory): a
    benchmark's first timed window waits for it. ``who`` names the caller in the error."""
    deadline = time.monotonic() + timeout_s
    while status(socket_path)["l1"].get("residency") in ("faulting", "registering"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{who}: the server's L1 prefault did not end within {timeout_s:.0f} s")
        time.sleep(0.05)


_LIST_KEYS_REQUEST = 0x0010


def list_keys(socket_path: Path, tier: str, timeout_s: float = DEADLINE_S) -> List[dict]:
    """The chunk keys tier ``tier`` ("l1" or a backend's name) of the server on
    ``socket_path`` holds (list_keys_request), each as {"model_id", "world_size", "rank",
    "hash"} (hex ids)."""
    t = tier.encode()
    doc = _json_call(socket_path, _LIST_KEYS_REQUEST, struct.pack("<I", len(t)) + t + struct.pack("<I", 0),
                     "list_keys", timeout_s)
    assert not doc["truncated"]
    out = []
    for k in doc["keys"]:
        model_id, world_size, rank, h = k.split("/")
        out.append({"model_id": model_id, "world_size": int(world_size), "rank": int(rank), "hash": h})
    return out


# --- connector options for tests ----------------------------------------------------------

#: Short deadlines so that the fault tests see a hung or dead server within a second or two.
FAST_TIMEOUTS_MS: Dict[str, int] = {
    "ping_interval_ms": 50,
    "ping_timeout_ms": 1000,
    "request_timeout_ms": 1000,
    "lookup_timeout_ms": 2000,
    "retrieve_timeout_ms": 1500,
    "store_timeout_ms": 2000,
    "reconnect_initial_ms": 20,
    "reconnect_max_ms": 200,
}


def options(
    socket_path: Path,
    model_name: str = "test/model",
    chunk_tokens: int = 16,
    rank: int = 0,
    world_size: int = 1,
    scheduler: Optional[bool] = None,
    fast: bool = True,
) -> kvtier.ConnectorOptions:
    o = kvtier.ConnectorOptions()
    o.socket_path = str(socket_path)
    o.model_name = model_name
    o.chunk_tokens = chunk_tokens
    o.rank = rank
    o.world_size = world_size
    o.scheduler = scheduler
    if fast:
        t = o.timeouts
        for k, v in FAST_TIMEOUTS_MS.items():
            setattr(t, k, v)
        o.timeouts = t
    return o


def wait_until(predicate, timeout_s: float = DEADLINE_S, what: str = "condition", poll_s: float = 0.005):
    """Polls ``predicate`` (a state another process or thread changes; there is no event to
    wait on from here) until it is true; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = predicate()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def finished(conn, rid, which, engine_finished=()):
    """A worker connection's get_finished until `rid` is in `which` ("sending"/"recving");
    returns every report seen meanwhile."""
    seen = {"sending": [], "recving": []}

    def poll():
        s, r = conn.get_finished(list(engine_finished))
        seen["sending"] += s
        seen["recving"] += r
        return rid in seen[which]

    wait_until(poll, what=f"{rid} finished {which}")
    return seen
