#!/usr/bin/env python3
"""FP8 against BF16 training (issue 41): examples/train_moe.py run three times with the same seeds,
the student's expert GEMMs in bf16, in fp8_block_scaled (WGRAD in BF16, the default) and in
fp8_block_scaled with fp8_wgrad (every GEMM in FP8: DeepSeek-V3's recipe) (docs/fp8.md), its losses
compared and plotted. On the CPU reference engine (the FP8 semantics) or the GPU (--device cuda).

    python3 bench/fp8_training/curve.py [--steps 300] [--device cpu] [--out JSON] [--png PNG]

The goal: each FP8 run's final loss (mean of the last --tail steps) within 1% of the BF16 run's.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from provenance import commit_of  # noqa: E402

GOAL = 0.01  # |fp8 - bf16| / bf16 of the final loss


RUNS = {"bf16": ["--gemm-precision", "bf16"], "fp8_block_scaled": ["--gemm-precision", "fp8_block_scaled"],
        "fp8_block_scaled+fp8_wgrad": ["--gemm-precision", "fp8_block_scaled", "--fp8-wgrad"]}


def run(name, args, path):
    cmd = [sys.executable, str(ROOT / "examples/train_moe.py"), "--device", args.device, "--steps", str(args.steps),
           *RUNS[name], "--losses", str(path)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tail", type=int, default=20, help="final loss: the mean of the last TAIL steps")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default="bench/results/fp8_training_cpu.json")
    ap.add_argument("--png", default="bench/results/fp8_training_cpu.png")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if not 1 <= args.tail <= args.steps:
        ap.error("--tail must be in [1, --steps]")
    with tempfile.TemporaryDirectory() as tmp:
        losses = {name: run(name, args, pathlib.Path(tmp) / f"{i}.json") for i, name in enumerate(RUNS)}
    final = {p: sum(v[-args.tail:]) / args.tail for p, v in losses.items()}
    gaps = {p: abs(final[p] - final["bf16"]) / final["bf16"] for p in RUNS if p != "bf16"}
    gap = max(gaps.values())
    result = {"benchmark": "fp8_training", "commit": commit_of(args.commit), "device": args.device,
              "run": "examples/train_moe.py defaults (T 64, D 128, F 128, E 8, K 2, 2 micro-batches, AdamW 1e-2)",
              "steps": args.steps, "tail": args.tail, "final_loss": final, "relative_gap": gaps, "goal": GOAL,
              "met": gap <= GOAL, "losses": losses}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"final loss (mean of the last {args.tail} of {args.steps} steps): "
          + ", ".join(f"{p} {v:.5f}" for p, v in final.items()) + "; gaps "
          + ", ".join(f"{p} {g:.2%}" for p, g in gaps.items()) + f" (goal <= {GOAL:.0%}) -> {args.out}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for p, v in losses.items():
        ax.plot(range(len(v)), v, label=p, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (MSE to the teacher)")
    ax.set_yscale("log")
    ax.set_title(f"train_moe.py on {args.device}: FP8 vs BF16 experts (largest gap {gap:.2%})", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    return 0 if gap <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
