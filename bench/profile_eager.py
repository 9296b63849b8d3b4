"""cProfile of eager forward+backward steps of the small layer of python_overhead.py on the GPU,
with the plain-eager bypass on and off (python_overhead's alternating timed rounds, then one profile
of each).

Usage: python3 bench/profile_eager.py   (needs an SM90 GPU and the module built)
"""

from __future__ import annotations

import cProfile
import pstats

import torch

import poise
from python_overhead import SHAPES, eager_layer, interleaved

STEPS = 200


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    _, context, step = eager_layer(poise.Config(**dict(SHAPES)["small"]), device)
    step()
    _, bypass_host_us, _, ops_host_us = interleaved(step, STEPS)
    print(f"host us per step: bypass {bypass_host_us:.1f}, ops {ops_host_us:.1f}")
    for bypass in (True, False):
        poise.torch_ops.EAGER_BYPASS = bypass
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(STEPS):
            step()
        profile.disable()
        torch.cuda.synchronize()
        print(f"---- bypass={bypass}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)
    poise.torch_ops.EAGER_BYPASS = True
    context.check()
    context.close()


if __name__ == "__main__":
    main()
