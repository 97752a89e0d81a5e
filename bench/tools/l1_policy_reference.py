#!/usr/bin/env python3
"""Reference simulators for kvtier_bench_l1_policies: textbook LRU and S3-FIFO (Yang et al.,
SOSP 2023, evicting on each insert, promotion after one read) on a Zipf 0.8 trace of the
bench's shape (100,000 keys, 1,000,000 requests, 10,000 objects). Its own random trace, so
its hit ratios match the bench's within about 0.002, not exactly. Takes about 10 s.

    bench/tools/l1_policy_reference.py
"""
import bisect
import collections
import random

N, C, R, ALPHA = 100_000, 10_000, 1_000_000, 0.8


def zipf_trace():
    w = [1 / (i + 1) ** ALPHA for i in range(N)]
    total, acc, cdf = sum(w), 0.0, []
    for x in w:
        acc += x / total
        cdf.append(acc)
    rng = random.Random(1)
    return [bisect.bisect_left(cdf, rng.random()) for _ in range(R)]


def lru(trace):
    od, hits = collections.OrderedDict(), 0
    for k in trace:
        if k in od:
            hits += 1
            od.move_to_end(k)
        else:
            od[k] = True
            if len(od) > C:
                od.popitem(last=False)
    return hits / len(trace)


def s3fifo(trace):
    small, main, ghost = collections.deque(), collections.deque(), collections.OrderedDict()
    freq = {}
    small_cap = max(1, int(0.1 * C))
    main_cap = C - small_cap

    def evict_main():
        while main:
            t = main.popleft()
            if freq[t] > 0:
                freq[t] -= 1
                main.append(t)
            else:
                del freq[t]
                return

    def evict_small():
        while small:
            t = small.popleft()
            if freq[t] >= 1:
                main.append(t)
                if len(main) > main_cap:
                    evict_main()
            else:
                del freq[t]
                ghost[t] = True
                if len(ghost) > main_cap:
                    ghost.popitem(last=False)
                return

    hits = 0
    for k in trace:
        if k in freq:
            hits += 1
            freq[k] = min(freq[k] + 1, 3)
            continue
        while len(small) + len(main) >= C:
            if len(small) >= small_cap:
                evict_small()
            else:
                evict_main()
        freq[k] = 0
        if k in ghost:
            del ghost[k]
            main.append(k)
        else:
            small.append(k)
    return hits / len(trace)


if __name__ == "__main__":
    t = zipf_trace()
    print(f"RESULT reference_lru_zipf_08_hit_ratio={lru(t):.6f}")
    print(f"RESULT reference_s3fifo_zipf_08_hit_ratio={s3fifo(t):.6f}")
