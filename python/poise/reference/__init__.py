"""The CPU reference from PyTorch: virtual ranks in one process, oracles, random inputs.

- ``Engine(config, ep_size)``, ``RankGradients`` (engines.py): one MoE layer across ``ep_size``
  virtual ranks, the C++ reference engine; ``forward`` / ``backward`` take one tensor per rank.
- ``dense_float64``, ``routed_experts_torch``, ``swiglu_torch`` (oracles.py): the float64 C++
  oracle and the layer in plain PyTorch ops.
- ``random_inputs``, ``ROUTINGS``, ``global_experts`` (inputs.py): inputs of every rank for tests
  and benchmarks, and every rank's experts as one tensor.

Tensors cross to C++ as float32 numpy arrays (arrays.py). Each name loads its module on first use,
so a CPU context, which runs on engines.py, never imports the oracles or the input generators.
See docs/pytorch.md.
"""

from __future__ import annotations

import importlib

_MODULE_OF = {
    "Engine": "engines",
    "RankGradients": "engines",
    "dense_float64": "oracles",
    "routed_experts_torch": "oracles",
    "swiglu_torch": "oracles",
    "random_inputs": "inputs",
    "ROUTINGS": "inputs",
    "global_experts": "inputs",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'poise.reference' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
