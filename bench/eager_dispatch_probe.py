"""Host cost of the two eager dispatch routes on a trivial op, no GPU and no Poise: a
torch.library custom_op with register_autograd against a plain autograd.Function, forward+backward
in alternating rounds (what torch_ops' plain-eager bypass saves, apart from Poise's own work).

Usage: python3 bench/eager_dispatch_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import Tensor


@torch.library.custom_op("poise_probe::forward", mutates_args=())
def probe_forward(x: Tensor, w: Tensor, handle: int, layout: str, accumulate: bool, deterministic: bool) -> Tensor:
    return torch.empty_like(x)


@probe_forward.register_fake
def _(x, w, handle, layout, accumulate, deterministic):
    return torch.empty_like(x)


@torch.library.custom_op("poise_probe::backward", mutates_args=())
def probe_backward(grad: Tensor, x: Tensor, w: Tensor, handle: int) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


@probe_backward.register_fake
def _(grad, x, w, handle):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.handle = inputs[2]


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    return (*torch.ops.poise_probe.backward(grad, x, w, ctx.handle), None, None, None, None)


torch.library.register_autograd("poise_probe::forward", _backward, setup_context=_setup)


class Direct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, handle, layout, accumulate, deterministic):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), None, None, None, None


def main() -> None:
    x = torch.randn(256, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    grad = torch.ones(256, 64)
    routes = {"torch.library custom_op": torch.ops.poise_probe.forward, "autograd.Function": Direct.apply}
    results = {name: [] for name in routes}
    for _ in range(5):
        for name, fn in routes.items():
            for _ in range(100):
                fn(x, w, 1, "a", False, True).backward(grad)
            start = time.perf_counter()
            for _ in range(2000):
                fn(x, w, 1, "a", False, True).backward(grad)
            results[name].append((time.perf_counter() - start) / 2000 * 1e6)
    for name, values in results.items():
        print(f"{name:<26} forward+backward {statistics.median(values):7.1f} us (rounds: "
              + ", ".join(f"{v:.1f}" for v in values) + ")")


if __name__ == "__main__":
    main()
