#!/usr/bin/env python3
"""Sorts SMs into L2 partitions from l2_partition_probe's CSV and says whether far lines get copied.

    python3 bench/l2_partition/analyze.py probe.csv
"""
import statistics
import sys

SHARED, OWN = 64, 32


def main() -> int:
    rows = [[int(v) for v in line.split(",")] for line in open(sys.argv[1]) if line.strip()]
    smid = [r[0] for r in rows]
    atom = [r[1:1 + SHARED] for r in rows]
    ld1 = [r[1 + SHARED:1 + SHARED + OWN] for r in rows]
    ld2 = [r[1 + SHARED + OWN:] for r in rows]
    # Near/far pattern of each SM over the shared lines: slower than the midpoint of its own 10th and
    # 90th percentiles = far (the lines need not split evenly between the partitions).
    def threshold(lat):
        s = sorted(lat)
        return (s[len(s) // 10] + s[9 * len(s) // 10]) / 2

    pattern = [[a > threshold(lat) for a in lat] for lat in atom]
    ref = pattern[0]
    dist = [sum(x != y for x, y in zip(p, ref)) for p in pattern]
    group = [0 if d < SHARED / 2 else 1 for d in dist]
    print("hamming distance of each SM's near/far pattern to the first SM's (0 or 64 = clean split):")
    print("  ", sorted(dist))
    for g in (0, 1):
        members = sorted(smid[i] for i in range(len(rows)) if group[i] == g)
        print(f"group {g}: {len(members)} SMs: {members}")
    near = [a for lat, p in zip(atom, pattern) for a, f in zip(lat, p) if not f]
    far = [a for lat, p in zip(atom, pattern) for a, f in zip(lat, p) if f]
    print(f"atomic latency, cycles: near median {statistics.median(near)}, far median {statistics.median(far)}")
    # Own lines: first load (home near or far) vs second (a copy in the near partition or not).
    first = [v for r in ld1 for v in r]
    second = [v for r in ld2 for v in r]
    first_median = statistics.median(first)
    print(f"own lines, first load: median {first_median}, p10 {sorted(first)[len(first) // 10]}, "
          f"p90 {sorted(first)[9 * len(first) // 10]}")
    print(f"own lines, second load: median {statistics.median(second)}, p10 {sorted(second)[len(second) // 10]}, "
          f"p90 {sorted(second)[9 * len(second) // 10]}")
    slow_first = [(a, b) for r1, r2 in zip(ld1, ld2) for a, b in zip(r1, r2) if a > first_median]
    print(f"lines whose first load was slower than the median: second load median "
          f"{statistics.median(b for _, b in slow_first)} (first {statistics.median(a for a, _ in slow_first)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
