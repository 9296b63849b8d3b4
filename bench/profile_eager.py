"""cProfile of eager forward+backward steps of the small layer of python_overhead.py on the GPU,
with the plain-eager bypass on and off (alternating timed rounds, then one profile of each).

Usage: python3 bench/profile_eager.py   (needs an SM90 GPU and the module built)
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import torch

import poise
from python_overhead import SHAPES, random_layer


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    config = poise.Config(**dict(SHAPES)["small"])
    layer = random_layer(config, device)
    leaves = [layer[n] for n in ("x_TD", "scores_TK", "w13", "w2")]
    args = [layer[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
    context = poise.create_context(config=config, device=device)

    def step():
        for t in leaves:
            t.grad = None
        out = poise.routed_experts(*args, context)
        out.backward(layer["grad_out_TD"])

    host = {True: [], False: []}
    for _ in range(5):
        for bypass in (True, False):
            poise.torch_ops.EAGER_BYPASS = bypass
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                step()
            host[bypass].append((time.perf_counter() - start) / 200 * 1e6)
            torch.cuda.synchronize()
    for bypass, values in host.items():
        print(f"bypass={bypass}: host us per step {statistics.median(values):.1f} ({', '.join(f'{v:.0f}' for v in values)})")
    for bypass in (True, False):
        poise.torch_ops.EAGER_BYPASS = bypass
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            step()
        profile.disable()
        torch.cuda.synchronize()
        print(f"---- bypass={bypass}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)
    context.check()
    context.close()


if __name__ == "__main__":
    main()
