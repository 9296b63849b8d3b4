"""Runs one Poise expert-MLP GEMM a few times on the benchmark's inputs, for a profiler (ncu) to look at.

    python3 bench/expert_mlp/profile_gemm.py LIB SHAPE GEMM [REPEATS]
    ncu --clock-control none --kernel-name regex:grouped_gemm --launch-skip 8 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 bench/expert_mlp/profile_gemm.py ...

SHAPE: a key of bench_expert_mlp.SHAPES; GEMM: fprop_w13, fprop_w2, dgrad_w2, dgrad_w13, wgrad_w2,
wgrad_w13. One forward and backward first fill every operand with real values (6 GEMM launches),
then the chosen GEMM runs REPEATS times (default 3).

GEMM "timeline" (with a library built with -DPOISE_TILE_TIMELINE=1): per GEMM, how far apart in
time the tiles that share an operand start.

GEMM "phases" (with a library built by `scripts/build_bench_variant.sh NAME -DPOISE_PHASE_PROFILE=1`):
runs each of the six GEMMs REPEATS times and prints where the consumer warpgroups' cycles go
(waiting for a stage, in the epilogue, the rest: issuing and waiting on wgmma) and how long the
producer waited for a free stage, per tile.
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_expert_mlp as bench  # noqa: E402


def main() -> int:
    lib_path, shape, gemm = sys.argv[1], sys.argv[2], sys.argv[3]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    P = bench.open_poise(lib_path)
    calls = bench.ready_block(P, shape, 1.0).gemm_calls
    if gemm == "phases":
        import ctypes
        fn = P.lib.pb_phase_profile
        fn.argtypes = [ctypes.c_void_p]
        buf = (ctypes.c_ulonglong * 8)()
        for name, call in calls.items():
            call()
            torch.cuda.synchronize()
            if fn(buf) != 0:
                print("not a profiling build (-DPOISE_PHASE_PROFILE=1)")
                return 1
            for _ in range(repeats):
                call()
            torch.cuda.synchronize()
            fn(buf)
            total, wait, epi, tiles, p_wait, p_total = (float(v) for v in buf[:6])
            print(f"{shape} {name}: per tile {total / tiles:,.0f} cycles = wait for stage {wait / tiles:,.0f} "
                  f"({100 * wait / total:.1f}%), epilogue {epi / tiles:,.0f} ({100 * epi / total:.1f}%), "
                  f"mma {(total - wait - epi) / tiles:,.0f} ({100 * (total - wait - epi) / total:.1f}%); "
                  f"producer waits for a free stage {100 * p_wait / max(p_total, 1):.1f}%", flush=True)
            ring_wait, emit = float(buf[6]), float(buf[7])
            if ring_wait + emit > 0:  # epilogues that split their own time (thread 0 of a warpgroup)
                print(f"    epilogue split: waiting for its ring stages {ring_wait / tiles:,.0f}, emitting and "
                      f"releasing {emit / tiles:,.0f}, the rest {(epi - ring_wait - emit) / tiles:,.0f} cycles per tile",
                      flush=True)
        return 0
    if gemm == "timeline":
        return timeline(P, shape, calls)
    for _ in range(repeats):
        calls[gemm]()
    torch.cuda.synchronize()
    print(f"{gemm} at {shape}: {repeats} runs after 6 warm-up GEMMs", flush=True)
    return 0


def timeline(P, shape, calls):
    """Per GEMM: how far apart the tiles that share an operand start (a POISE_TILE_TIMELINE build).

    Tiles of one expert with the same N block read the same B (weights, or the wgrad N operand);
    tiles with the same M block read the same A. L2 serves the later readers only while the first
    reader's lines are still cached, so the spread of their start times against a tile's duration
    says whether operand sharing can work through L2."""
    import ctypes
    import statistics
    n = 1 << 16
    start, end = (ctypes.c_ulonglong * n)(), (ctypes.c_ulonglong * n)()
    what, sm = (ctypes.c_uint * n)(), (ctypes.c_uint * n)()
    fn = P.lib.pb_tile_timeline
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int]
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        if fn(start, end, what, sm, n) != 0:
            print("not a timeline build (-DPOISE_TILE_TIMELINE=1)")
            return 1
        call()
        torch.cuda.synchronize()
        fn(start, end, what, sm, n)
        tiles = [(start[i], end[i], what[i], sm[i]) for i in range(n) if start[i] and not what[i] >> 31]
        t0 = min(t[0] for t in tiles)
        dur = statistics.median(t[1] - t[0] for t in tiles)
        span = max(t[1] for t in tiles) - t0

        def spread(key):
            groups = {}
            for t in tiles:
                groups.setdefault(key(t[2]), []).append(t[0])
            s = sorted(max(v) - min(v) for v in groups.values() if len(v) > 1)
            return s[len(s) // 2] / dur, s[int(len(s) * 0.9)] / dur, statistics.mean(len(v) for v in groups.values())

        b_med, b_p90, b_n = spread(lambda w: (w >> 16, (w >> 8) & 0xFF))
        a_med, a_p90, a_n = spread(lambda w: (w >> 16, w & 0xFF))
        print(f"{shape} {name}: {len(tiles)} tiles, {span / 1e3:.0f} us, tile {dur / 1e3:.1f} us; start spread of "
              f"tiles sharing B (x{b_n:.1f}): median {b_med:.2f}, p90 {b_p90:.2f} tiles; sharing A (x{a_n:.1f}): "
              f"median {a_med:.2f}, p90 {a_p90:.2f} tiles", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
