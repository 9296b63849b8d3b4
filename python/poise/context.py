"""poise.Context: owns every buffer of one MoE layer's routed experts on this rank.

Contract: creation and close() are collective (every rank of the EP group, same Config); a context
is sequentially reusable (one call in flight, calls ordered on the stream); after an aborted call,
reset() before the next one; after close(), reset() and calls raise poise.InvalidArgument.
"""

from __future__ import annotations

from . import _poise
from .config import Config, from_cpp, to_cpp
from .errors import as_index
from .plan import MemoryPlan, plan_from_cpp


class Context:
    """A Poise context for rank ``rank`` of an EP group of ``ep_size`` ranks. Collective to create."""

    def __init__(self, config: Config, *, ep_size: int, rank: int):
        self._cpp = _poise.Context.create(to_cpp(config), as_index("ep_size", ep_size), as_index("rank", rank))

    @property
    def config(self) -> Config:
        return from_cpp(self._cpp.config)

    @property
    def plan(self) -> MemoryPlan:
        return plan_from_cpp(self._cpp.plan)

    @property
    def ep_size(self) -> int:
        return self._cpp.ep_size

    @property
    def rank(self) -> int:
        return self._cpp.rank

    @property
    def closed(self) -> bool:
        return self._cpp.closed

    def reset(self) -> None:
        """Recovers after an aborted call (an exception, a device timeout). Raises once closed."""
        self._cpp.reset()

    def close(self) -> None:
        """Releases every buffer. Collective; closing a closed context does nothing."""
        self._cpp.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<poise.Context rank {self.rank} of {self.ep_size}, {state}>"


def create_context(*, config: Config, ep_size: int, rank: int) -> Context:
    """Creates this rank's Context; every rank of the EP group calls it with the same config."""
    return Context(config, ep_size=ep_size, rank=rank)
