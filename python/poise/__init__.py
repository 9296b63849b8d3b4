"""Poise: the routed experts of Mixture-of-Experts layers across expert-parallel GPUs.

Importing poise does no CUDA work and needs no GPU: Config, plan_memory and the errors are pure
host code. The PyTorch parts (poise.routed_experts, poise.routed_experts_virtual, poise.torch,
poise.reference) import torch on first use. See docs/python.md and docs/pytorch.md.
"""

from .errors import DeviceError, InvalidArgument, NotAvailable  # first: the extension raises these
from . import _poise
from .config import Config
from .context import Context, create_context
from .options import ExecutionOptions
from .plan import MemoryPlan, plan_memory
from .telemetry import RoutingStats, plot_routing

cuda_device_count = _poise.cuda_device_count

__all__ = [
    "Config",
    "Context",
    "DeviceError",
    "ExecutionOptions",
    "InvalidArgument",
    "MemoryPlan",
    "NotAvailable",
    "PreparedWeights",
    "RoutingStats",
    "create_context",
    "cuda_device_count",
    "plan_memory",
    "prepare_weights",
    "plot_routing",
    "routed_experts",
    "routed_experts_virtual",
]
__version__ = "0.1.0"

# The PyTorch parts load on first use, so `import poise` imports neither torch nor numpy.
_LAZY_MODULES = ("reference", "torch")
_TORCH_ENTRY_POINTS = ("PreparedWeights", "prepare_weights", "routed_experts", "routed_experts_virtual")


def __getattr__(name: str):
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _TORCH_ENTRY_POINTS:
        return getattr(importlib.import_module(".torch", __name__), name)
    raise AttributeError(f"module 'poise' has no attribute {name!r}")
