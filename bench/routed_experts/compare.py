#!/usr/bin/env python3
"""Side by side: routed_experts_bench JSON files of several builds (labels), e.g. this build's and one
built against an older libpoise, run alternately in one device call (scripts/device_session.sh bench).

Per label and case, the median over the label's runs of each run's median, and the label's time
over the first label's (the label of the first file named).

Usage: python3 bench/routed_experts/compare.py RUN.json [RUN.json ...]
"""
import json
import statistics
import sys


def medians_by_label(runs):
    """{label: {(shape, routing): {"fwd_ms": median, "fwdbwd_ms": median, "runs": n}}}, labels in
    first-seen order."""
    times = {}
    for run in runs:
        cases = times.setdefault(run["label"], {})
        for case in run["cases"]:
            entry = cases.setdefault((case["shape"], case["routing"]), {"fwd_ms": [], "fwdbwd_ms": []})
            for key in ("fwd_ms", "fwdbwd_ms"):
                entry[key].append(case[key])
    return {label: {case: {"fwd_ms": statistics.median(t["fwd_ms"]), "fwdbwd_ms": statistics.median(t["fwdbwd_ms"]),
                           "runs": len(t["fwd_ms"])} for case, t in cases.items()}
            for label, cases in times.items()}


def table(medians):
    """One line per label and case; x fwd / x fwdbwd: the label's time over the first label's."""
    labels = list(medians)
    first = medians[labels[0]]
    lines = [f"x fwd, x fwdbwd: time over {labels[0]}'s",
             f"{'label':<28} {'shape':<21} {'routing':<12} {'fwd ms':>8} {'fwdbwd ms':>10} {'runs':>4} {'x fwd':>6} "
             f"{'x fwdbwd':>8}"]
    for case in first:
        for label in labels:
            m = medians[label].get(case)
            if m is None:
                continue
            lines.append(f"{label:<28} {case[0]:<21} {case[1]:<12} {m['fwd_ms']:8.3f} {m['fwdbwd_ms']:10.3f} "
                         f"{m['runs']:4d} {m['fwd_ms'] / first[case]['fwd_ms']:6.3f} "
                         f"{m['fwdbwd_ms'] / first[case]['fwdbwd_ms']:8.3f}")
    return "\n".join(lines)


def main(paths):
    if not paths:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    print(table(medians_by_label(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
