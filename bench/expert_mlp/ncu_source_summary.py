#!/usr/bin/env python3
"""Where a kernel's warps wait, from ncu's source page (scripts/device_session.sh ncu).

    python3 bench/expert_mlp/ncu_source_summary.py NCU_SRC.csv.gz [MIN_PERCENT]

Prints the SASS as runs of instructions with one execution count (a loop body, a straight-line
piece), each run's share of the warp-state samples and its most sampled instruction with that
instruction's top stall reasons: enough to tell the consumers' stage waits (the try-wait loop after
SYNCS.PHASECHK), their wgmma waits (WARPGROUP.DEPBAR), the epilogues and the idle producer warps
(UCGABAR_WAIT, the final cluster barrier) apart.
"""
import csv
import gzip
import sys


def main() -> int:
    rows = list(csv.reader(gzip.open(sys.argv[1], "rt")))
    min_share = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = lambda r: int(r[col["Warp Stall Sampling (All Samples)"]] or 0)  # noqa: E731
    total = sum(samples(r) for r in data)
    runs = []
    for r in data:
        executed = int(r[col["Instructions Executed"]] or 0)
        if not runs or runs[-1]["executed"] != executed:
            runs.append(dict(first=r[0], last=r[0], executed=executed, samples=0, count=0, top=None))
        run = runs[-1]
        run.update(last=r[0], samples=run["samples"] + samples(r), count=run["count"] + 1)
        if run["top"] is None or samples(r) > samples(run["top"]):
            run["top"] = r
    print(f"{sys.argv[1]}: {total} samples, {len(data)} instructions")
    for run in runs:
        if run["samples"] < min_share / 100 * total:
            continue
        top = run["top"]
        reasons = sorted(((int(top[col[h]] or 0), h[6:]) for h in stalls), reverse=True)[:2]
        print(f"  {run['first'][-5:]}-{run['last'][-5:]} {run['count']:4d} instr x{run['executed']:>9d}: "
              f"{100 * run['samples'] / total:5.1f}%  top {top[1].strip()[:48]:48s} {reasons}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
