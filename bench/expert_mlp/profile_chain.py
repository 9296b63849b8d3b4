#!/usr/bin/env python3
"""Times every step of the benchmark's two Poise forward+backward chains, in chain order, with CUDA
events (median of REPS chains after WARM_MS of the same chain): where each chain's time goes.

  default: the in-order combines (forward: a glue kernel; backward: the WGRADs' side job), as
           PoiseBlock runs it by default;
  fused:   the combines fused into FPROP W2 and DGRAD W13 (PoiseBlock.fused_combine).

The events between steps cost the chain its programmatic-dependent-launch overlap, so the chain
total here is a little above the bench's block timing.

    python3 bench/expert_mlp/profile_chain.py LIB [SHAPE] [REPS] [WARM_MS]
"""
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_expert_mlp as bench  # noqa: E402


def chain_steps(c, fused):
    """(name, call) of one forward+backward: PoiseBlock's own steps, in the chain the bench times."""
    c.blk.fused_combine = fused
    return (list(c.blk.forward_steps(c.x, c.ids, c.scores, c.w13, c.w2, c.out)) +
            list(c.blk.backward_steps(c.grad_out, c.w13, c.w2, c.gx, c.g13, c.g2, c.gs)))


def profile(c, fused, reps, warm_ms):
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < warm_ms:
        for _, fn in chain_steps(c, fused):
            fn()
        torch.cuda.synchronize()
    times, host_us = {}, {}
    for _ in range(reps):
        events = []
        for name, fn in chain_steps(c, fused):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            t0 = time.perf_counter()
            fn()
            host_us.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
            e.record()
            events.append((name, s, e))
        torch.cuda.synchronize()
        for name, s, e in events:
            times.setdefault(name, []).append(s.elapsed_time(e))
        times.setdefault("chain", []).append(events[0][1].elapsed_time(events[-1][2]))
    # Host time of each step's Python call (its launches): the chain starts on an idle GPU, so its
    # first steps wait for the host.
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: statistics.median(v) for k, v in host_us.items()})


def first_call_host_us(c, trials=20):
    """Host us of the layout step right after a synchronize, then of the same step again at once, and
    of one 4-byte memset after a synchronize: what the chain's first launch pays for starting from an
    idle stream, against the step itself."""
    scratch = torch.zeros(1, device="cuda", dtype=torch.int32)
    firsts, seconds, memsets = [], [], []
    for _ in range(trials):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        c.blk.layout(c.ids, c.scores)
        t1 = time.perf_counter()
        c.blk.layout(c.ids, c.scores)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        scratch.zero_()
        t4 = time.perf_counter()
        firsts.append((t1 - t0) * 1e6)
        seconds.append((t2 - t1) * 1e6)
        memsets.append((t4 - t3) * 1e6)
    return statistics.median(firsts), statistics.median(seconds), statistics.median(memsets)


def main() -> int:
    lib_path = sys.argv[1]
    shape = sys.argv[2] if len(sys.argv) > 2 else "deepseek_v3_ep8_rank"
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    warm_ms = float(sys.argv[4]) if len(sys.argv) > 4 else 300.0
    P = bench.open_poise(lib_path)
    for skew_target in (1, 3):
        c = bench.ready_block(P, shape, skew_target)
        first, second, memset = first_call_host_us(c)
        print(f"{shape} skew {c.skew:.2f}: layout host us after a sync {first:.0f}, right after another {second:.0f}; "
              f"a torch zero_ after a sync {memset:.0f}", flush=True)
        for fused in (False, True):
            time.sleep(1.0)  # each chain from the same cool start, as the bench's blocks
            med, host = profile(c, fused, reps, warm_ms)
            steps_sum = sum(v for k, v in med.items() if k != "chain")
            print(f"{shape} skew {c.skew:.2f} {'fused' if fused else 'default'}: chain {med['chain']:.2f} ms, "
                  f"steps {steps_sum:.2f} ms: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items() if k != "chain"),
                  flush=True)
            print("   host us per step: " + ", ".join(f"{k} {v:.0f}" for k, v in host.items()) +
                  f" (all {sum(host.values()):.0f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
