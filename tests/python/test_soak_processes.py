"""The soak's process helpers (bench/soak/soak/processes.py) do what its fault schedule
assumes: a Redis restart fault kills Redis and starts it again later; two restarts drawn
close together (the two-hour run drew them 0.4 s apart) schedule two starts, and the second
must not start a second redis-server, nor lose the handle of the one that serves."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "soak"))

from soak.processes import RedisProcess  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (Debian: redis-server)")


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def test_two_restarts_close_together_leave_one_redis_that_the_next_fault_reaches(tmp_path):
    r = RedisProcess(shutil.which("redis-server"), tmp_path)
    try:
        first = r.proc
        r.kill()  # restart 1: killed, its start pending
        r.kill()  # restart 2, drawn 0.4 s later: nothing left to kill, another start pending
        r.start()  # restart 1's start
        serving = r.proc
        r.start()  # restart 2's start: Redis already runs: it is the one the handle keeps
        assert r.proc is serving and r.running() and serving is not first
        # The next fault reaches the Redis that serves: after a kill nothing answers.
        r.kill()
        assert not answers(r.port), "a redis-server the soak no longer holds still serves its port"
    finally:
        r.kill()
