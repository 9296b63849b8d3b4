"""Contexts over a torch.distributed group on CUDA: one NCCL communicator per context, owned by Poise.

poise.create_context(group=..., device="cuda") comes here (collective over the group):
  1. rank 0 of the group draws an ncclUniqueId (poise._poise_nccl.unique_id());
  2. the id travels to every rank through the group (torch.distributed.broadcast_object_list);
  3. every rank runs ncclCommInitRank(group size, id, group rank) on its CUDA device, then the C++
     Context::create_from_nccl over it (NCCL window + staged pipeline, allocated now);
  4. Context.close() releases the pipeline (deregisters the window), then destroys the communicator.

The communicator is Poise's own: it is not the group's NCCL communicator and does not need the group
to use the NCCL backend (gloo works too: only the 128-byte id crosses the group).

libnccl.so.2: poise._poise_nccl links it; `import poise` and poise._poise never load this module.
At import the library must already be loaded or loadable: importing torch first loads the one its
CUDA wheel ships (nvidia-nccl-cu*), which the loader then reuses; failing that, this module preloads
<site-packages>/nvidia/nccl/lib/libnccl.so.2. Poise checks that the loaded NCCL is the minor release
it was built against (the window device API is new) and raises NotAvailable otherwise.

Limits: all ranks in one NVLink domain (NCCL's LSA team); ranks across nodes need NCCL GIN, which
this build does not implement (NotAvailable). A rank that fails during creation leaves the others
waiting in ncclCommInitRank or the window registration (NCCL's own timeouts apply).
"""

from __future__ import annotations

import ctypes
import importlib
import os
from typing import Any

from .errors import DeviceError, NotAvailable


def _preload_wheel_nccl() -> bool:
    """Loads libnccl.so.2 from the nvidia-nccl wheel (RTLD_GLOBAL) if that wheel is installed."""
    try:
        import nvidia.nccl  # namespace package: no __file__, its __path__ lists the folders
    except ImportError:
        return False
    for folder in getattr(nvidia.nccl, "__path__", []):
        library = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.exists(library):
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
            return True
    return False


def load_native() -> Any:
    """poise._poise_nccl, importing torch first (it loads libnccl.so.2). NotAvailable if absent."""
    import torch  # noqa: F401  (loads torch's libnccl.so.2 where its CUDA wheel has one)

    try:
        return importlib.import_module("._poise_nccl", __package__)
    except ModuleNotFoundError:
        raise NotAvailable(
            "poise was built without its NCCL module (poise._poise_nccl: needs NCCL >= 2.28 with "
            "nccl_device.h at build time); create_context(group=..., device='cuda') is not available"
        ) from None
    except ImportError as first:
        if "libnccl" not in str(first) or not _preload_wheel_nccl():
            raise NotAvailable(f"poise._poise_nccl cannot be loaded ({first}); import torch first, or install "
                               "nvidia-nccl-cu13, or put libnccl.so.2 on LD_LIBRARY_PATH") from None
        return importlib.import_module("._poise_nccl", __package__)


def _device_index(device: str) -> int:
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("create_context: no CUDA device; a context over a group on 'cuda' needs an SM90 GPU")
    return int(device.partition(":")[2]) if ":" in device else torch.cuda.current_device()


def attach_nccl_communicator(context: Any, group: Any) -> None:
    """Gives a new poise.Context (rank and ep_size taken from `group`, still without a GPU engine) its
    C++ context over a fresh NCCL communicator of the group's ranks. Collective over `group`."""
    import torch
    import torch.distributed as dist

    try:
        native = load_native()
        index = _device_index(context.device)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        with torch.cuda.device(index):  # broadcast_object_list stages through the current device (NCCL)
            unique_id = [native.unique_id() if rank == 0 else None]
            dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0), group=group)
            cpp = native.create_context(context._cpp.config, unique_id[0], size, rank, index)
    except BaseException:
        context.close()
        raise
    planned_only, context._cpp = context._cpp, cpp
    planned_only.close()  # it only validated and planned; it holds no GPU memory
    context._device = f"cuda:{index}"  # the window and buffers live there
