"""Poise: the routed experts of Mixture-of-Experts layers across expert-parallel GPUs.

Importing poise does no CUDA work and needs no GPU: Config, plan_memory and the errors are pure
host code. See docs/python.md.
"""

from .errors import DeviceError, InvalidArgument, NotAvailable  # first: the extension raises these
from . import _poise
from .config import Config
from .context import Context, create_context
from .plan import MemoryPlan, plan_memory

cuda_device_count = _poise.cuda_device_count

__all__ = [
    "Config",
    "Context",
    "DeviceError",
    "InvalidArgument",
    "MemoryPlan",
    "NotAvailable",
    "create_context",
    "cuda_device_count",
    "plan_memory",
]
__version__ = "0.1.0"
