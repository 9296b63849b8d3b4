#!/usr/bin/env python3
"""The GPU timeline of one benchmark forward+backward chain (torch.profiler): every kernel and
memset in order with the idle gap before it and its duration, the host time to enqueue forward
and backward, and the slowest host-side CUDA calls. Shows whether the chain is GPU-bound (gaps
of 1-2 us) and what each glue kernel costs without the host in the measurement.

    python3 bench/expert_mlp/profile_timeline.py LIB [SHAPE,SHAPE...]
"""
import pathlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_expert_mlp as bench  # noqa: E402


def main() -> int:
    P = bench.open_poise(sys.argv[1])
    shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(bench.SHAPES)
    for shape in shapes:
        c = bench.ready_block(P, shape, 1.0)
        for _ in range(5):
            c.forward()
            c.backward()
        torch.cuda.synchronize()
        c.forward()
        c.backward()  # keeps the GPU busy while the next chain is enqueued and timed on the host
        t0 = time.perf_counter()
        c.forward()
        t1 = time.perf_counter()
        c.backward()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{shape}: host enqueue forward {1e3 * (t1 - t0):.3f} ms, backward {1e3 * (t2 - t1):.3f} ms")
        chains = 3
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(chains):
                c.forward()
                c.backward()
            torch.cuda.synchronize()
        gpu = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        n = len(gpu) // chains
        prev_end, busy = None, 0.0
        for e in gpu[n:2 * n]:  # the middle chain
            gap = 0.0 if prev_end is None else (e.time_range.start - prev_end) / 1e3
            dur = (e.time_range.end - e.time_range.start) / 1e3
            busy += dur
            print(f"  gap {gap:7.3f}  dur {dur:7.3f} ms  {e.name[:90]}")
            prev_end = e.time_range.end
        print(f"  GPU busy {busy:.3f} ms in one chain")
        cpu = sorted((e for e in prof.events() if e.device_type.name == "CPU"),
                     key=lambda e: e.time_range.start - e.time_range.end)[:8]
        for e in cpu:
            print(f"  host {(e.time_range.end - e.time_range.start) / 1e3:8.3f} ms  {e.name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
