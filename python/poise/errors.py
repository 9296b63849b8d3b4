"""Errors raised by Poise. The C++ exceptions of include/poise/errors.hpp arrive as these classes."""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A bad argument or Config field, caught on the host before anything is launched.

    ``name`` is the offending field or argument (``"top_k"``, ``"ep_size"``, ...), ``rule`` the rule it
    breaks; ``str(error)`` is ``"name: rule"``, exactly the C++ message.
    """

    def __init__(self, name: str, rule: str):
        super().__init__(f"{name}: {rule}")
        self.name = name
        self.rule = rule

    def __reduce__(self):
        return (type(self), (self.name, self.rule))


class NotAvailable(RuntimeError):
    """A feature that exists in the API but whose implementation has not landed in this build."""


class DeviceError(RuntimeError):
    """A failure reported by the device: a CUDA error, the device error word, a timeout."""


def as_index(name: str, value: object) -> int:
    """An integer argument (int, numpy integer, anything with __index__), or InvalidArgument naming it."""
    if isinstance(value, bool):
        raise InvalidArgument(name, f"must be an integer, got {value!r}")
    try:
        return value.__index__()  # type: ignore[attr-defined]
    except AttributeError:
        raise InvalidArgument(name, f"must be an integer, got {type(value).__name__} {value!r}") from None
