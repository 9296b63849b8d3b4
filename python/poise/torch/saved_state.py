"""What an engine keeps between a forward and its backward, and how it finds it again.

A backward gets the same tensors as its forward (autograd saved them), so the forward's inputs
identify it: ``call_identity``. The CUDA engine remembers one C++ activation record per identity;
the CPU engines keep only their latest forward (``LatestForward``): a backward for any other
forward (layers sharing a context, a no_grad forward in between) recomputes that forward first.
Both decisions are taken on the host, so a captured CUDA graph replays the same sequence. The
counters are what tests read.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch


def call_identity(tensors: Sequence[torch.Tensor]) -> tuple:
    """Tells whether a backward's inputs are those of a forward: same memory, shape, dtype and
    version counter mean the same values (views share the version counter). Tensors made under
    torch.inference_mode() keep no version counter, and no backward can take them: -1."""
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype, -1 if t.is_inference() else t._version) for t in tensors)


class LatestForward:
    """The CPU engines' saved-state policy: the latest forward only, recomputed when it is not."""

    def __init__(self) -> None:
        self._latest: Optional[Any] = None
        self.forward_calls = 0
        self.backward_calls = 0
        self.recomputed_forwards = 0

    def reset(self) -> None:
        self._latest = None

    def latest_routing_stats(self) -> Optional[Any]:
        """The reference engine's RoutingStats of the latest forward (None before one)."""
        return self._routing_stats() if self._latest is not None else None

    def _routing_stats(self) -> Any:
        raise NotImplementedError

    def _run_forward(self, key: Any, launch: Callable[[], Any]) -> Any:
        """Runs ``launch`` and remembers ``key`` as the latest forward once it succeeded."""
        self._latest = None
        result = launch()
        self._latest = key
        return result

    def _ensure_forward(self, key: Any, launch: Callable[[], Any], always: bool = False) -> None:
        """Before a backward: recompute the forward ``key`` unless it is the latest (or ``always``)."""
        if always or self._latest != key:
            self._run_forward(key, launch)
            self.recomputed_forwards += 1
