#!/usr/bin/env python3
"""Reads in flight and their latency, per process, from io_uring's tracepoints.

Tells whether two readers of the same files (kvtier-server's disk backend and the long-doc
driver's disk probe, say) kept the same depth and saw the same device: a reader that keeps
fewer reads in flight is slower by its own doing; two at the same depth whose reads take
longer at one moment than another measured the device (or the host's throttle), not
themselves.

    perf record -e io_uring:io_uring_submit_req -e io_uring:io_uring_complete -a -o io.data -- CMD
    perf script -i io.data | bench/tools/uring_inflight.py [COMM ...]

Prints, per process name (default: every one that submitted reads): reads (READ and
READ_FIXED), median and p90 latency from submission to completion, the mean number in
flight while any was, and that busy time. Needs perf (Debian package linux-perf) and
tracepoint access (root).
"""
import re
import sys

LINE = re.compile(r"\s*(\S+)\s+\d+\s+\[\d+\]\s+([\d.]+):\s+io_uring:(\w+):")
READS = ("READ", "READ_FIXED")


def main() -> int:
    wanted = set(sys.argv[1:])
    events = []
    for line in sys.stdin:
        m = LINE.match(line)
        if not m:
            continue
        op = re.search(r"opcode (\w+)", line)
        ud = re.search(r"user_data (0x[0-9a-f]+)", line)
        events.append((m.group(1), float(m.group(2)), m.group(3), op.group(1) if op else None,
                       ud.group(1) if ud else None))
    events.sort(key=lambda e: e[1])
    comms = sorted({c for c, _, k, op, _ in events if k == "io_uring_submit_req" and op in READS})
    for comm in comms:
        if wanted and comm not in wanted:
            continue
        pending, lat = {}, []
        inflight, area, busy, last = 0, 0.0, 0.0, None
        for c, t, kind, op, ud in events:
            # Completions may be posted from another thread (io-wq): match them by user_data.
            if kind == "io_uring_submit_req" and c == comm and op in READS:
                if last is not None and inflight:
                    area += inflight * (t - last)
                    busy += t - last
                pending[ud] = t
                inflight += 1
                last = t
            elif kind == "io_uring_complete" and ud in pending:
                lat.append(t - pending.pop(ud))
                if inflight:
                    area += inflight * (t - last)
                    busy += t - last
                inflight -= 1
                last = t
        if not lat or busy == 0:
            continue
        lat.sort()
        print(f"{comm}: {len(lat)} reads, latency median {lat[len(lat) // 2] * 1e3:.2f} ms, "
              f"p90 {lat[int(len(lat) * 0.9)] * 1e3:.2f} ms, {area / busy:.1f} in flight while busy, "
              f"busy {busy:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
