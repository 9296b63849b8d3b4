#!/usr/bin/env python3
"""Times every step of the benchmark's Poise forward+backward chain, in chain order, with CUDA
events (median of REPS chains): where the chain's time goes, e.g. balanced against skewed routing.

    python3 bench/expert_mlp/profile_chain.py LIB [SHAPE] [REPS]
"""
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_expert_mlp as bench  # noqa: E402


def main() -> int:
    lib_path = sys.argv[1]
    shape = sys.argv[2] if len(sys.argv) > 2 else "deepseek_v3_ep8_rank"
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    P = bench.open_poise(lib_path)
    T, D, F, E, K = bench.SHAPES[shape]
    for skew_target in (1, 3):
        c = bench.ready_block(P, shape, skew_target)
        blk, L, gemm = c.blk, c.blk.lay, c.gemm_calls
        skew = c.skew

        def steps():
            yield "layout", lambda: blk.layout(c.ids, c.scores)
            yield "gather_x", lambda: blk.gather_x(c.x)
            yield "fprop_w13", gemm["fprop_w13"]
            yield "fprop_w2", gemm["fprop_w2"]
            yield "combine", lambda: blk.combine(blk.y_rows, c.out)
            yield "scatter_grad", lambda: P.scatter_rows(L["row_of_tk"], T * K, K, D, c.grad_out, blk.gy_rows)
            yield "dgrad_w2", gemm["dgrad_w2"]
            yield "wgrad_w2", gemm["wgrad_w2"]
            yield "dgrad_w13", gemm["dgrad_w13"]
            yield "wgrad_w13", gemm["wgrad_w13"]
            yield "combine_grad", lambda: blk.combine(blk.gx_rows, c.gx)
            yield "gather_scalars", lambda: blk.score_sums(c.gs)

        times = {}
        for r in range(reps + 2):
            events = []
            for name, fn in steps():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                events.append((name, s, e))
            first, last = events[0][1], events[-1][2]
            torch.cuda.synchronize()
            if r < 2:
                continue
            for name, s, e in events:
                times.setdefault(name, []).append(s.elapsed_time(e))
            times.setdefault("chain", []).append(first.elapsed_time(last))
        med = {k: statistics.median(v) for k, v in times.items()}
        steps_sum = sum(v for k, v in med.items() if k != "chain")
        print(f"{shape} skew {skew:.2f}: chain {med['chain']:.2f} ms, steps {steps_sum:.2f} ms: " +
              ", ".join(f"{k} {v:.3f}" for k, v in med.items() if k != "chain"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
