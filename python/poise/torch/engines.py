"""What executes a call: the engine behind a context, created on its first call.

| context | engine |
|---|---|
| CUDA, one rank or virtual ranks | cuda_engine.CudaEngine |
| CPU, one rank (alone or in a torch.distributed group) | cpu_engines.CpuRankEngine |
| CPU, virtual ranks | cpu_engines.CpuVirtualRanksEngine |

Every engine has ``forward`` / ``backward`` (one rank's tensors) or ``forward_ranks`` /
``backward_ranks`` (one tuple of tensors per rank), ``reset()`` and the counters forward_calls,
backward_calls and recomputed_forwards that tests read.
"""

from __future__ import annotations

from typing import Any

from ..context import Context
from .cuda_engine import CudaEngine


def engine_of(context: Context) -> Any:
    """The context's engine (context._backend), created on first use."""
    if context._backend is None:
        context._backend = CudaEngine(context) if context.device != "cpu" else _cpu_engine(context)
    return context._backend


def _cpu_engine(context: Context) -> Any:
    # Imported here, not above: a CUDA context never loads the reference engine (numpy), and
    # poise.reference.engines, which imports this package's checks, may be the import in progress.
    from .cpu_engines import CpuRankEngine, CpuVirtualRanksEngine

    return CpuVirtualRanksEngine(context) if context.virtual_ranks else CpuRankEngine(context)
