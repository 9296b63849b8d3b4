"""GPU timing shared by the benchmarks: blocks of calls timed with CUDA events on a settled card."""
from __future__ import annotations

import statistics
import time

import torch


def time_block(fn, reps, settle_s, warm_ms):
    """Median ms of reps calls, each from an idle GPU (CUDA events around it), after settle_s idle
    and at least warm_ms (and 3 calls) of warm-up: the card runs power-limited, and a block that
    started in another block's hot stretch would inherit its clocks. Returns (ms, (start, end)) with
    the timed window in time.time() for the clock samples."""
    torch.cuda.synchronize()
    time.sleep(settle_s)
    start, calls = time.perf_counter(), 0
    while calls < 3 or (time.perf_counter() - start) * 1e3 < warm_ms:
        fn()
        calls += 1
        torch.cuda.synchronize()
    window_start = time.time()
    events = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        events.append((s, e))
    return statistics.median(s.elapsed_time(e) for s, e in events), (window_start, time.time())
