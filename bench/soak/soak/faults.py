"""The fault schedule, drawn from the seed: what breaks when, and for how long.

Each fault is injected by the soak's main loop (kvtier_soak.py) through the callbacks it
gives; a fault with a duration (a stopped process, a full disk) is ended by the schedule at
its time, or at a quiet point, whichever comes first."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

#: Every kind, with its weight in the draw. Kinds that end the server process are drawn only
#: before ``server_faults_until`` (the measured run after it keeps one server process, so
#: that its RSS and descriptors can be followed for an hour).
KINDS: Dict[str, float] = {
    "server_kill": 1.0,  # SIGKILL, restarted at once on the same socket
    "server_restart": 0.5,  # SIGTERM (graceful), restarted
    "server_stop": 1.0,  # SIGSTOP for 0.5-4 s: the server hangs, its socket open
    "engine_kill": 1.5,  # SIGKILL of a replay worker in a step that loads, or of the mini engine
    "client_disconnect": 1.0,  # raw clients that leave mid-frame, mid-request, before the answer
    "disk_corrupt": 1.0,  # bytes of stored objects flipped (a failing disk, a stray writer)
    "disk_delete": 0.5,  # object files unlinked under the server
    "disk_full": 1.0,  # the disk L2's file system filled for 2-8 s (ENOSPC)
    "redis_restart": 0.7,  # redis-server SIGKILLed, back empty after 0.2-2 s
    "redis_stop": 0.7,  # redis-server SIGSTOPped for 0.5-4 s
}
SERVER_ENDING = ("server_kill", "server_restart")


@dataclass
class Fault:
    t: float  # seconds into the run
    kind: str
    detail: str = ""
    ends_at: Optional[float] = None


@dataclass
class FaultSchedule:
    rng: random.Random
    mean_interval_s: float
    duration_s: float
    server_faults_until_s: float
    kinds: Tuple[str, ...] = ()  # only these (empty: every kind)
    unavailable: Tuple[str, ...] = ()
    injected: List[Fault] = field(default_factory=list)
    active: List[Tuple[Fault, Callable[[], None]]] = field(default_factory=list)
    next_at: float = 0.0

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}: use {', '.join(KINDS)}")
        self.next_at = self.rng.expovariate(1.0 / self.mean_interval_s)

    def draw(self, now: float) -> Optional[str]:
        """The kind due now, or None."""
        if now < self.next_at:
            return None
        self.next_at = now + self.rng.expovariate(1.0 / self.mean_interval_s)
        kinds = [k for k in KINDS if k not in self.unavailable and (not self.kinds or k in self.kinds)
                 and (now < self.server_faults_until_s or k not in SERVER_ENDING)]
        if not kinds:
            return None
        return self.rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]

    def record(self, now: float, kind: str, detail: str = "", lasts_s: float = 0.0, end: Optional[Callable[[], None]] = None) -> None:
        f = Fault(now, kind, detail, now + lasts_s if end is not None else None)
        self.injected.append(f)
        if end is not None:
            self.active.append((f, end))

    def end_due(self, now: float, everything: bool = False) -> None:
        keep = []
        for f, end in self.active:
            if everything or now >= (f.ends_at or 0):
                end()
            else:
                keep.append((f, end))
        self.active = keep

    def counts(self) -> Dict[str, int]:
        out = {k: 0 for k in KINDS}
        for f in self.injected:
            out[f.kind] += 1
        return out
