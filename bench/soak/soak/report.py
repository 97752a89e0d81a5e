"""The soak's record and its summary: samples (CSV), faults, failures, the table printed at
the end, and an SVG of RSS, descriptors and hit rate over time (no plotting package needed)."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional


@dataclass
class Sample:
    t: float
    boot: int
    rss_kib: int
    rss_anon_kib: int  # the server's private memory (RssAnon)
    rss_shmem_kib: int  # engines' region pages it touched (RssShmem): theirs, not its own
    heap_in_use_kib: int  # the server's malloc heap handed out (/status "memory"); 0 if not glibc
    heap_free_kib: int  # free inside its arenas, kept by the allocator (RSS holds it)
    fds: int
    connections: int
    registrations: int
    hit_tokens: float  # since the boot
    requested_tokens: float
    quiet: bool = False


@dataclass
class Failure:
    t: float
    invariant: str
    detail: str


@dataclass
class Record:
    seed: int
    duration_s: float
    samples: List[Sample] = field(default_factory=list)
    failures: List[Failure] = field(default_factory=list)

    def fail(self, t: float, invariant: str, detail: str) -> None:
        self.failures.append(Failure(round(t, 1), invariant, detail))
        print(f"[{t:8.1f} s] INVARIANT BROKEN {invariant}: {detail}", flush=True)

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(asdict(self.samples[0]).keys()) if self.samples else ["t"])
            w.writeheader()
            for s in self.samples:
                w.writerow(asdict(s))


def hit_rate_series(samples: List[Sample]) -> List[tuple]:
    """(t, hit rate of the tokens looked up since the previous sample) per sample; a restart
    (counters back to zero) starts again from the new boot's counters."""
    out = []
    prev: Optional[Sample] = None
    for s in samples:
        if prev is None or s.boot != prev.boot:
            dh, dr = s.hit_tokens, s.requested_tokens
        else:
            dh, dr = s.hit_tokens - prev.hit_tokens, s.requested_tokens - prev.requested_tokens
        if dr > 0:
            out.append((s.t, dh / dr))
        prev = s
    return out


def growth_per_hour(points: List[tuple]) -> Optional[float]:
    """The least-squares slope of (t s, value) as a share of the first value, per hour."""
    if len(points) < 3 or points[-1][0] - points[0][0] < 600:
        return None
    n = len(points)
    mt = sum(p[0] for p in points) / n
    mv = sum(p[1] for p in points) / n
    var = sum((p[0] - mt) ** 2 for p in points)
    slope = sum((p[0] - mt) * (p[1] - mv) for p in points) / var
    return slope * 3600 / points[0][1]


def pct_per_hour(growth: Optional[float]) -> str:
    return f"{growth * 100:.2f}% per hour" if growth is not None else "n/a (under 10 min of one boot)"


def svg(samples: List[Sample], faults: List[tuple], path: Path, title: str) -> None:
    """Three stacked panels: server memory (RSS, its own part, the heap in use; MiB), open
    descriptors, hit rate; fault marks on top."""
    if not samples:
        return
    W, H, pad, gap = 900, 520, 60, 30
    ph = (H - 2 * pad - 2 * gap) / 3
    t1 = max(s.t for s in samples) or 1.0
    # Each panel: its name and its lines (label, colour, points); the first line is the
    # panel's scale.
    memory = [("RSS", "#1f77b4", [(s.t, s.rss_kib / 1024) for s in samples])]
    if any(s.rss_anon_kib for s in samples):
        memory.append(("own (RssAnon)", "#ff7f0e", [(s.t, s.rss_anon_kib / 1024) for s in samples]))
    if any(s.heap_in_use_kib for s in samples):
        memory.append(("heap in use", "#2ca02c", [(s.t, s.heap_in_use_kib / 1024) for s in samples]))
    panels = [
        ("server memory (MiB): " + ", ".join(f"{label} ({'blue' if c == '#1f77b4' else 'orange' if c == '#ff7f0e' else 'green'})"
                                            for label, c, _ in memory), memory),
        ("server open fds", [("fds", "#1f77b4", [(s.t, s.fds) for s in samples])]),
        ("token hit rate", [("hit rate", "#1f77b4", hit_rate_series(samples))]),
    ]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{pad}" y="20" font-size="13">{title}</text>']
    for i, (name, lines) in enumerate(panels):
        top = pad + i * (ph + gap)
        out.append(f'<rect x="{pad}" y="{top:.0f}" width="{W - 2 * pad}" height="{ph:.0f}" fill="none" stroke="#999"/>')
        if not lines[0][2]:
            continue
        lo = 0.0
        hi = max(p[1] for p in lines[0][2]) * 1.1 or 1.0
        if name == "token hit rate":
            hi = 1.0
        for _, colour, pts in lines:
            xy = " ".join(f"{pad + (t / t1) * (W - 2 * pad):.1f},{top + ph - (v - lo) / (hi - lo) * ph:.1f}" for t, v in pts)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.2" points="{xy}"/>')
        out.append(f'<text x="{pad + 4}" y="{top + 12:.0f}">{name}</text>')
        out.append(f'<text x="{pad - 4}" y="{top + 10:.0f}" text-anchor="end">{hi:.4g}</text>')
        out.append(f'<text x="{pad - 4}" y="{top + ph:.0f}" text-anchor="end">0</text>')
    colors = {"server_kill": "#d62728", "server_restart": "#ff7f0e", "redis_restart": "#9467bd"}
    for t, kind in faults:
        if kind in colors:
            x = pad + (t / t1) * (W - 2 * pad)
            out.append(f'<line x1="{x:.1f}" y1="{pad - 8}" x2="{x:.1f}" y2="{H - pad}" stroke="{colors[kind]}" stroke-opacity="0.35"/>')
    out.append(f'<text x="{pad}" y="{H - pad + 20}">seconds 0 .. {t1:.0f}; vertical lines: server SIGKILL (red), '
               'graceful restart (orange), Redis restart (purple)</text>')
    out.append("</svg>")
    path.write_text("\n".join(out))


def table(rows: List[tuple]) -> str:
    w = max(len(str(r[0])) for r in rows)
    return "\n".join(f"  {str(k).ljust(w)}  {v}" for k, v in rows)


def write_json(path: Path, doc: Dict) -> None:
    path.write_text(json.dumps(doc, indent=2, default=str))
