#!/usr/bin/env python3
"""kvtier_soak: hours of mixed load and faults against one kvtier-server, and the check that
everything it hands out comes back (docs/performance.md, "Soak").

Engines: replay engines in vLLM's split (the scheduler in this process, each TP rank a worker
process with its own connection; tests/python/replay), one TP=2 NHD and one TP=1 HND, with
shared prefixes, long documents beyond L1, several salts, aborts and preemptions; and the C++
mini engine, one short job after another. L2: a disk backend on a small tmpfs and a Redis.
Faults from the seed (soak/faults.py). Every served KV row is checked by the engine that
reads it. At every quiet point the server must hold nothing and its books must balance
(soak/invariants.py), the engines must hold nothing, and the server's descriptors must be
back where they were.

    /usr/bin/python3 bench/soak/kvtier_soak.py --duration 7200 --seed 7 --out /tmp/soak

Exit status 0: no invariant broke; 1: one did (the first is printed with the seed and the
time to replay it); 2: the soak could not start.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (quiet points and the drain come on top)")
    p.add_argument("--seed", type=int, default=1, help="draws the prompts, the faults and their times")
    p.add_argument("--build-dir", type=Path, default=REPO / "build", help="a kvtier build (examples/, python/)")
    p.add_argument("--out", type=Path, default=None, help="where samples.csv, faults.csv, soak.json, soak.svg and the logs go (default: a temporary directory, kept)")
    p.add_argument("--quiet-every", type=float, default=None, help="seconds between quiet points (default: duration/3, at most 300)")
    p.add_argument("--fault-every", type=float, default=None, help="mean seconds between faults (default: 4 in runs under 5 min, else 15)")
    p.add_argument("--server-faults-until", type=float, default=0.5, help="share of the run after which the server is no more killed or restarted (the measured run)")
    p.add_argument("--faults", default="", help="only these fault kinds, comma-separated (default: all; soak/faults.py lists them)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS / fd / hit-rate samples")
    p.add_argument("--stop-on-failure", action="store_true", help="end at the first broken invariant")
    a = p.parse_args(argv)
    # The options given on the command line (the replay line repeats them).
    given = argv if argv is not None else sys.argv[1:]
    a.explicit = {x.lstrip("-").split("=", 1)[0].replace("-", "_") for x in given if x.startswith("--")}
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    sys.path.insert(0, str(a.build_dir / "python"))
    sys.path.insert(0, str(REPO / "tests" / "python"))
    sys.path.insert(0, str(HERE))
    try:
        from soak.run import Soak
    except ImportError as e:
        print(f"kvtier_soak: cannot import kvtier from {a.build_dir / 'python'} ({e}): build it first "
              f"(cmake --build {a.build_dir} --target kvtier_python kvtier-server kvtier_mini_engine)", file=sys.stderr)
        return 2
    out = a.out or Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    soak = Soak(a, out)
    # SIGTERM (ctest's timeout, kill) ends it like Ctrl-C: the servers stop, the tmpfs goes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        soak.start()
    except Exception as e:  # a missing program, a port, a server refusing its configuration
        print(f"kvtier_soak: cannot start: {e}", file=sys.stderr)
        soak.close()
        return 2
    try:
        soak.run()
    finally:
        soak.close()
    return soak.summarize()


if __name__ == "__main__":
    sys.exit(main())
