#!/usr/bin/env python3
"""How far each expert GEMM's tile schedule is from the ideal makespan, on the CPU.

A model, not a measurement: the bench's balanced routing (uniform top-k), tiles or cluster groups
in the kernels' expert-major order (tile_scheduler.cuh), a tile costing 1.0, or 0.55 when its rows
fit in one 64-row slab and the kernel skips the other (the SwiGLU-backward kernel does not), and a
wgrad tile costing its K blocks + 4 (epilogue and ramp, from the phase profiles). Prints, per GEMM,
the rounds of groups per cluster slot, and static striding (what the kernels do: group t on slot
t mod G) and greedy dynamic assignment (each group to the first free slot) against the ideal
(total cost / G).

    python3 bench/expert_mlp/tail_model.py
"""
import heapq

import numpy as np

SHAPES = {"deepseek_v3_ep8_rank": (4096, 7168, 2048, 32, 8), "qwen3_30b_a3b": (8192, 2048, 768, 128, 8)}


def balanced_counts(T, E, K, rng):
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K]  # K distinct experts per token
    return np.bincount(ids.ravel(), minlength=E)


def rows_as_m_groups(counts, n_blocks, cluster, skips_empty_slabs=True):
    groups = []
    for c in counts:
        m_blocks = (c + 127) // 128

        def cost(m):
            return 0.55 if skips_empty_slabs and min(128, c - 128 * m) <= 64 else 1.0

        if cluster == 1:
            groups += [cost(m) for _ in range(n_blocks) for m in range(m_blocks)]
            continue
        groups += [max(cost(2 * i), cost(2 * i + 1)) for _ in range(n_blocks) for i in range(m_blocks // 2)]
        if m_blocks % 2:
            groups += [cost(m_blocks - 1)] * ((n_blocks + 1) // 2)
    return groups


def rows_as_k_groups(counts, m_blocks, n_blocks, cluster):
    groups = []
    for c in counts:
        groups += [(c + 63) // 64 + 4] * ((m_blocks * n_blocks + cluster - 1) // cluster)
    return groups


def makespans(groups, slots):
    g = np.array(groups, float)
    static = max(g[s::slots].sum() for s in range(slots))
    free = [0.0] * slots
    for cost in g:
        heapq.heappush(free, heapq.heappop(free) + cost)
    ideal = g.sum() / slots
    return len(g) / slots, static / ideal, max(free) / ideal


def main():
    rng = np.random.default_rng(1234)
    for name, (T, D, F, E, K) in SHAPES.items():
        counts = balanced_counts(T, E, K, rng)
        print(f"{name}: rows per expert {counts.min()}..{counts.max()}")
        gemms = {  # (groups, cluster slots on 132 SMs)
            "fprop_w13": (rows_as_m_groups(counts, 2 * F // 256, 2), 66),
            "fprop_w2": (rows_as_m_groups(counts, D // 256, 2), 66),
            "dgrad_w2": (rows_as_m_groups(counts, (F + 255) // 256, 1, skips_empty_slabs=False), 132),
            "dgrad_w13": (rows_as_m_groups(counts, D // 256, 2), 66),
            "wgrad_w2": (rows_as_k_groups(counts, (D + 127) // 128, (F + 255) // 256, 2), 66),
            "wgrad_w13": (rows_as_k_groups(counts, (2 * F + 127) // 128, (D + 255) // 256, 2), 66),
        }
        for gemm, (groups, slots) in gemms.items():
            rounds, static, dynamic = makespans(groups, slots)
            print(f"  {gemm:10s} {rounds:6.2f} rounds  static {static:.3f}  dynamic {dynamic:.3f} x ideal")


if __name__ == "__main__":
    main()
