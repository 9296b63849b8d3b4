"""poise.ExecutionOptions: per-call switches of routed_experts. Plain data, no torch needed."""

from __future__ import annotations

import dataclasses

from .errors import InvalidArgument


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionOptions:
    """How one routed_experts call runs (the layer's shapes and buffers live in the Config).

    Results are bitwise reproducible run to run: the same inputs, Config, EP size and options give
    the same bits, forward and backward. Every sum has a fixed order (the combine adds each token's
    top-k picks in fp32 in k order, one writer per slot, no float atomics), so no option trades
    reproducibility for speed.

    accumulate_wgrad: backward adds the weight grads into the existing accumulation buffers
        (``w.main_grad`` if the parameter has one, else ``w.grad``) in place, and autograd gets
        ``None`` for w13 and w2 (docs/pytorch.md, "Weight-gradient accumulation").
    clip_statistics: routed_experts also returns, per local expert, how many gate inputs the
        clamped SwiGLU clipped (above swiglu_limit) and how many up inputs (outside
        [-limit, limit]): int64 [E_local, 2], over the expert's rows on every rank.
    sync_check: for hunting a bad batch: the call waits for its stream and raises
        poise.DeviceError in that call if the device faulted (an expert id out of range or picked
        twice, a capacity overflow), and so does its backward (eager calls). Without it a fault
        raises at the next call, and the faulted call's outputs are NaN. Not while a CUDA graph is
        captured. ``create_context(sync_check=True)`` or ``POISE_SYNC_CHECK=1`` check every call.
    """

    accumulate_wgrad: bool = False
    clip_statistics: bool = False
    sync_check: bool = False

    def validate(self) -> None:
        """Raises poise.InvalidArgument naming a field that is not a bool."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise InvalidArgument(field.name, f"must be a bool, got {type(value).__name__} {value!r}")
