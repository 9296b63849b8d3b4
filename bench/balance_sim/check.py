#!/usr/bin/env python3
"""How close bench/balance_sim's EP2 predictions come to the 2 x H200 measurements.

Reads the simulator's JSON (default bench/results/balance_sim.json) and the multi-GPU benchmark's
(default bench/results/multigpu_h200.json: DeepSeek-V3 per-rank shape, forward+backward per
balance mode and peak/mean), prints predicted / measured per case, and adds them to the
simulator's JSON under "vs_measured".

Usage: python3 bench/balance_sim/check.py [SIM_JSON] [MEASURED_JSON]
"""
from __future__ import annotations

import json
import pathlib
import sys

MODES = {"capacity": "poise_capacity_fwdbwd_ms", "exact": "poise_exact_fwdbwd_ms",
         "tolerance_0.5": "poise_exact_tol0.5_fwdbwd_ms"}


def compare(sim: dict, measured: dict) -> list[dict]:
    world = measured["world"]
    predicted = {(c["peak_mean"], c["mode"]): c["predicted_fwdbwd_ms"] for c in sim["cases"] if c["ranks"] == world}
    rows = []
    for layer in measured["layer"]:
        for mode, key in MODES.items():
            want = predicted.get((layer["peak_mean_target"], mode))
            if want is None or key not in layer:
                continue
            rows.append({"ranks": world, "peak_mean": layer["peak_mean_target"], "mode": mode,
                         "predicted_ms": want, "measured_ms": layer[key], "ratio": want / layer[key],
                         "measured_commit": measured.get("commit")})
    return rows


def main(argv: list[str]) -> int:
    sim_path = pathlib.Path(argv[1] if len(argv) > 1 else "bench/results/balance_sim.json")
    measured_path = pathlib.Path(argv[2] if len(argv) > 2 else "bench/results/multigpu_h200.json")
    sim, measured = json.loads(sim_path.read_text()), json.loads(measured_path.read_text())
    rows = compare(sim, measured)
    if not rows:
        print(f"no case of {sim_path} matches {measured_path} (EP{measured['world']})", file=sys.stderr)
        return 1
    for r in rows:
        print(f"EP{r['ranks']} peak/mean {r['peak_mean']:<4g} {r['mode']:<14} predicted {r['predicted_ms']:7.2f} ms"
              f"  measured {r['measured_ms']:7.2f} ms  ratio {r['ratio']:.3f}")
    sim["vs_measured"] = rows
    sim_path.write_text(json.dumps(sim, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
