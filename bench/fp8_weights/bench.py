#!/usr/bin/env python3
"""poise.prepare_weights on the GPU: FP8 block-scaled expert weights refilled in place (out=), the
per-step cost of training with prepared weights. Bandwidth counted as bf16 read + e4m3 written +
scales written, against the card's copy bandwidth measured in the same run (a bf16 tensor of the
same size copied with torch).

Usage: python3 bench/fp8_weights/bench.py [--out FILE] [--reps 20]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

import poise

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/: provenance, device identity
from provenance import commit_of  # noqa: E402
from smi_sampler import device_identity  # noqa: E402
from timing import time_block  # noqa: E402

DEFAULT_OUT = "bench/results/fp8_weights_h200.json"
SHAPES = {  # local experts, F, D
    "DeepSeek-V3 rank (EP8)": (32, 2048, 7168),
    "Qwen3-30B-A3B (EP1)": (128, 768, 2048),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    rows = {}
    for name, (E, F, D) in SHAPES.items():
        w13 = (torch.randn(E, 2 * F, D, device="cuda") * D**-0.5).bfloat16()
        w2 = (torch.randn(E, D, F, device="cuda") * F**-0.5).bfloat16()
        prepared = poise.prepare_weights(w13, w2)
        ms, _ = time_block(lambda: poise.prepare_weights(w13, w2, out=prepared), args.reps, 0.2, 50.0)
        elements = w13.numel() + w2.numel()
        scales = prepared.w13_scales.numel() + prepared.w2_scales.numel()
        bytes_moved = 2 * elements + elements + 4 * scales
        source = torch.empty(elements, dtype=torch.bfloat16, device="cuda")
        target = torch.empty_like(source)
        copy_ms, _ = time_block(lambda: target.copy_(source), args.reps, 0.2, 50.0)
        rows[name] = {"experts": E, "F": F, "D": D, "ms": ms, "GB_per_s": bytes_moved / ms / 1e6,
                      "copy_GB_per_s": 2 * 2 * elements / copy_ms / 1e6}
        rows[name]["fraction_of_copy"] = rows[name]["GB_per_s"] / rows[name]["copy_GB_per_s"]
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[name].items()}, flush=True)
        del w13, w2, prepared, source, target
        torch.cuda.empty_cache()
    result = {"benchmark": "fp8_weights", "commit": commit_of(args.commit),
              "device": {"torch_name": torch.cuda.get_device_name(), **device_identity()}, "reps": args.reps,
              "results": rows, "torch": torch.__version__, "seconds": time.perf_counter() - started}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
