"""The processes a soak runs beside the engines: redis-server, the disk L2's small file
system, the mini engine (C++), and what /proc says of a process (RSS, open descriptors)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident_set(pid: int) -> Optional[dict]:
    """The process's resident set (KiB) and its parts, from /proc/PID/status: "rss" (VmRSS) =
    "anon" (its private memory: heap, stacks, L1) + "file" (its binary and libraries) +
    "shmem" (shared memory it touched: for the server, the pages of the engines' registered
    KV regions it copied to or from, which belong to the engines' memfds)."""
    names = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = names.get(line.split(":", 1)[0] + ":")
            if key:
                out[key] = int(line.split()[1])
    except OSError:
        return None
    return out if "rss" in out else None


def open_fds(pid: int) -> Optional[int]:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def fd_kinds(pid: int) -> dict:
    """Open descriptors by kind (socket, pipe, anon_inode:[eventfd], memfd, a path's
    directory), to say what a growing count is made of."""
    out: dict = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for n in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{n}")
        except OSError:
            continue
        if target.startswith(("socket:", "pipe:")):
            kind = target.split(":")[0]
        elif target.startswith("anon_inode:"):
            kind = target
        elif target.startswith("/memfd:"):
            kind = "memfd"
        else:
            kind = os.path.dirname(target)
        out[kind] = out.get(kind, 0) + 1
    return out


class RedisProcess:
    """A redis-server on loopback with no persistence: a restart comes back empty, as a
    Redis that lost its memory does."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        """Starts redis-server, or nothing where ours runs (two restart faults drawn close
        together schedule two starts: a second redis-server would fail to bind, answer
        nothing, and take the handle of the one that serves, which no fault would reach
        again). Raises where the port answers but not from our process."""
        if self.running():
            return
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        if self.proc.poll() is None:
                            return
                        break  # another process serves the port
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}, or another process serves it")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGCONT)


class DiskDir:
    """The disk L2's directory: a small tmpfs of its own when this user may mount one (so
    that a full disk is a real ENOSPC, and filling it touches nothing else), else a plain
    temporary directory (then the full-disk fault is not available, and the summary says so)."""

    def __init__(self, parent: Path, size_mb: int) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="disk-l2-", dir=parent))
        self.mounted = False
        self.size_bytes = size_mb << 20
        if os.geteuid() == 0:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "kvtier-soak", str(self.path)],
                               capture_output=True)
            self.mounted = r.returncode == 0

    def fill(self) -> int:
        """Fills the file system to its last byte; returns the bytes taken. Only its own tmpfs,
        still mounted and of its size: never the disk under it (an unmounted directory)."""
        if not self.mounted or not self.is_own_mount():
            return 0
        target = self.path / ".soak-filler"
        taken = 0
        for block in (1 << 20, 4096):  # then what is left of less than a block
            try:
                with open(target, "ab", buffering=0) as f:
                    while taken + block <= self.size_bytes:
                        taken += f.write(b"\0" * block)
            except OSError:  # ENOSPC: full (already full: not even the file could be made)
                pass
        return taken

    def is_own_mount(self) -> bool:
        if not os.path.ismount(self.path):
            return False
        st = os.statvfs(self.path)
        return st.f_blocks * st.f_frsize <= self.size_bytes

    def unfill(self) -> None:
        try:
            (self.path / ".soak-filler").unlink()
        except FileNotFoundError:
            pass

    def object_files(self) -> List[Path]:
        out = []
        for root, _dirs, files in os.walk(self.path):
            for f in files:
                if f.endswith(".kvo"):  # <path>/objects/<ss>/<key>.kvo (docs/l2-disk.md)
                    out.append(Path(root) / f)
        return out

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)


class MiniEngine:
    """The C++ mini engine (examples/mini_engine), one short job at a time: documents it
    sends twice (the second round hits), every retrieved row checked against recomputation.
    A job the soak killed is not judged; every other one must report ok."""

    def __init__(self, binary: Path, socket_path: Path, workdir: Path, chunk_tokens: int) -> None:
        self.binary = binary
        self.socket_path = socket_path
        self.workdir = workdir
        self.chunk_tokens = chunk_tokens
        self.proc: Optional[subprocess.Popen] = None
        self.jobs = 0
        self.killed = 0
        self.ok = 0
        self.requests = 0  # requests of the jobs that ended ok, every output verified
        self.report_path = workdir / "mini-engine.json"
        self.log_path = workdir / "mini-engine.log"
        self._killed_this = False

    def start(self, rng) -> None:
        self.jobs += 1
        self._killed_this = False
        try:
            self.report_path.unlink()
        except FileNotFoundError:
            pass
        args = [str(self.binary), "--socket", str(self.socket_path), "--documents", str(rng.randint(2, 6)),
                "--tokens", str(rng.choice([200, 600, 1500])), "--rounds", "2", "--tokens-per-second", "0",
                "--world-size", str(rng.choice([1, 2])), "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                "--num-blocks", "2048", "--chunk-size", str(self.chunk_tokens), "--model", "soak/mini-engine",
                "--json", str(self.report_path)]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> bool:
        if not self.running():
            return False
        self.proc.kill()
        self.proc.wait()
        self._killed_this = True
        self.killed += 1
        return True

    def poll(self) -> Optional[str]:
        """None while running or idle; after a job ended: "" when it was ok (or killed by the
        soak), else what went wrong."""
        if self.proc is None or self.proc.poll() is None:
            return None
        rc = self.proc.returncode
        self.proc = None
        if self._killed_this:
            return ""
        try:
            report = json.loads(self.report_path.read_text())
        except (OSError, ValueError) as e:
            return f"mini engine exited {rc} without a report ({e}); log: {self._log_tail()}"
        if rc != 0 or not report.get("ok"):
            rounds = [{k: r.get(k) for k in ("completed", "wrong_outputs", "corrupt_rows", "duplicate_finished")}
                      for r in report.get("rounds", [])]
            wrong = any(r["wrong_outputs"] or r["corrupt_rows"] for r in rounds)
            return f"mini engine job failed{' with wrong KV' if wrong else ''} (exit {rc}): {rounds}; log: {self._log_tail()}"
        self.ok += 1
        self.requests += sum(r.get("completed", 0) for r in report.get("rounds", []))
        return ""

    def wait(self, timeout_s: float) -> Optional[str]:
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return f"mini engine job did not end within {timeout_s:.0f} s"
        return self.poll()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-800:]
        except OSError:
            return ""
