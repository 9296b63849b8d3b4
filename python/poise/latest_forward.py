"""The saved-state policy every engine behind a context shares.

An engine keeps what backward needs from its latest forward only. It remembers which forward that
was (a key built from the inputs' identity); a backward for any other forward (layers sharing a
context, a no_grad forward in between) recomputes that forward first. The decision is taken on the
host, so a captured CUDA graph replays the same sequence. The counters are what tests read.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


class LatestForward:
    def __init__(self) -> None:
        self._latest: Optional[Any] = None
        self.forward_calls = 0
        self.backward_calls = 0
        self.recomputed_forwards = 0

    def reset(self) -> None:
        self._latest = None

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
