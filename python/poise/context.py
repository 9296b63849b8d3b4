"""poise.Context: owns every buffer of one MoE layer's routed experts on this rank.

Contract: creation and close() are collective (every rank of the EP group, same Config); a context
is sequentially reusable (one call in flight, calls ordered on the stream); after an aborted call,
reset() before the next one; after close(), reset() and calls raise poise.InvalidArgument.

A context runs on a device: 'cuda' (the GPU engine: the C++ Context) or 'cpu' (the CPU reference
engine, for tests and development); the torch ops create the engine on first use. Nothing here imports
torch unless a torch.distributed group is passed.
"""

from __future__ import annotations

import itertools
import atexit
import weakref
from typing import Any, Optional

from . import _poise
from .config import Config, from_cpp, to_cpp
from .errors import DeviceError, InvalidArgument, as_index
from .plan import MemoryPlan, plan_from_cpp

# Live contexts by handle: the torch ops carry the handle (an int), not the object.
_live_contexts: "weakref.WeakValueDictionary[int, Context]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def _device_name(device: object) -> str:
    """'cpu', 'cuda' or 'cuda:N' from a string or a torch.device (str(torch.device('cuda', 1)) == 'cuda:1')."""
    name = device if isinstance(device, str) else str(device)
    kind, _, index = name.partition(":")
    if kind == "cpu" and not index:
        return name
    if kind == "cuda" and (not index or (index.isdigit() and str(int(index)) == index)):
        return name
    raise InvalidArgument("device", f"must be 'cpu', 'cuda' or 'cuda:N' (or a torch.device), got {device!r}")


class _ClosedContext:
    """What a released Context holds instead of its C++ object: closed, and nothing else works."""

    closed = True

    def close(self) -> None:
        pass


class Context:
    """A Poise context for rank ``rank`` of an EP group of ``ep_size`` ranks. Collective to create."""

    def __init__(self, config: Config, *, ep_size: int, rank: int, device: object = "cuda", group: Any = None,
                 virtual_ranks: bool = False, sync_check: bool = False):
        if not isinstance(sync_check, bool):
            raise InvalidArgument("sync_check", f"must be a bool, got {type(sync_check).__name__}")
        self.sync_check = sync_check  # every call checks its device faults (ExecutionOptions.sync_check)
        self._device = _device_name(device)
        ep_size, rank = as_index("ep_size", ep_size), as_index("rank", rank)
        self._virtual_ranks = bool(virtual_ranks)
        if self._virtual_ranks and self._device != "cpu":
            self._device, self._cpp = _create_virtual_ranks_on_gpu(config, ep_size, self._device)
        else:
            # A CPU virtual-ranks context runs poise.reference.Engine: the C++ Context only plans.
            self._cpp = _poise.Context.create(to_cpp(config), ep_size, rank)
        if self._device == "cpu" and ep_size > 1 and group is None and not self._virtual_ranks:
            self._cpp.close()
            raise InvalidArgument(
                "group",
                f"a CPU context with ep_size={ep_size} needs the torch.distributed group of its ranks; "
                "for all ranks in one process pass virtual_ranks=True",
            )
        self._group = group
        self._backend: Any = None  # the engine the torch ops run on, created on first use
        self._activation_slot: Optional[tuple[int, int]] = None  # the latest selection
        self.handle = next(_handles)
        _live_contexts[self.handle] = self

    @property
    def config(self) -> Config:
        return from_cpp(self._cpp.config)

    @property
    def plan(self) -> MemoryPlan:
        return plan_from_cpp(self._cpp.plan)

    @property
    def device_bytes(self) -> int:
        """GPU contexts: device bytes held per rank (communication window and buffers), to compare
        with plan.total_device_bytes; 0 before the first call allocated them, and on the CPU."""
        return 0 if self._device == "cpu" else self._cpp.device_bytes

    @property
    def ep_size(self) -> int:
        return self._cpp.ep_size

    @property
    def rank(self) -> Optional[int]:
        """This process's rank in the EP group; None for a virtual-ranks context (it is every rank)."""
        return None if self._virtual_ranks else self._cpp.rank

    @property
    def virtual_ranks(self) -> bool:
        """True: this context drives all ep_size ranks in this process (poise.routed_experts_virtual
        takes one tensor per rank); False: one rank (poise.routed_experts)."""
        return self._virtual_ranks

    @property
    def device(self) -> str:
        """'cpu', 'cuda' (any CUDA device) or 'cuda:N': where this context's tensors must live."""
        return self._device

    @property
    def group(self) -> Any:
        """The torch.distributed group of the EP ranks, or None (one rank, or virtual ranks)."""
        return self._group

    @property
    def closed(self) -> bool:
        return self._cpp.closed

    @property
    def activation_slot(self) -> Optional[tuple[int, int]]:
        """(slot, num_moe_layers_in_slot) of the latest select_activation_slot; None before any (forwards
        then run from the working buffers) and always for an inference context."""
        return self._activation_slot

    def select_activation_slot(self, slot: int, num_moe_layers_in_slot: int = 1) -> None:
        """The next ``num_moe_layers_in_slot`` forwards (that will have a backward) keep their state
        in activation slot ``slot``: layer positions 0, 1, ... of it.

        A slot keeps ``plan.activation_records_per_slot`` layers whole (routing layout, received x
        rows, h13), until the slot is selected again; the layers past its room, and forwards past
        ``num_moe_layers_in_slot``, run from the working buffers, and their backward rebuilds what it
        needs (routing, dispatch, the W13 GEMM; no W2 GEMM, no combine). Without a selection every
        forward runs from the working buffers, kept until the next forward. Collective: every rank
        selects the same slots in the same order. Typical use: one slot per pipeline micro-batch in
        flight, selected before the micro-batch's forward. See docs/pytorch.md.
        """
        self._require_open()
        config = self._cpp.config
        if config.inference:
            raise InvalidArgument("context", "was created with inference=true: it has no activation slots")
        slot = as_index("slot", slot)
        num_layers = as_index("num_moe_layers_in_slot", num_moe_layers_in_slot)
        if not 0 <= slot < config.num_activation_slots:
            raise InvalidArgument(
                "slot", f"must be in [0, num_activation_slots={config.num_activation_slots}), got {slot}"
            )
        limit = config.max_moe_layers_per_activation_slot
        if not 1 <= num_layers <= limit:
            raise InvalidArgument(
                "num_moe_layers_in_slot",
                f"must be in [1, max_moe_layers_per_activation_slot={limit}], got {num_layers}",
            )
        self._cpp.select_activation_slot(slot, num_layers)
        self._activation_slot = (slot, num_layers)

    def enable_stage_timing(self, on: bool = True) -> None:
        """Diagnostics (GPU contexts): record a CUDA event at every stage boundary of each call
        (a few microseconds per stage); read them with stage_times()."""
        self._require_open()
        if self._device == "cpu":
            raise InvalidArgument("context", "stage timing is for GPU contexts (the CPU reference has no stages)")
        self._cpp.enable_stage_timing(bool(on))

    def stage_times(self) -> dict[str, dict[str, float]]:
        """{'forward': {stage: ms}, 'backward': {stage: ms}} of the last calls, in call order (all launch
        ranks together); waits for the current CUDA stream. See enable_stage_timing()."""
        self._require_open()
        if self._device == "cpu":
            raise InvalidArgument("context", "stage timing is for GPU contexts (the CPU reference has no stages)")
        import torch

        device = torch.device(self._device) if ":" in self._device else None
        forward, backward = self._cpp.stage_times(torch.cuda.current_stream(device).cuda_stream)
        return {"forward": dict(forward), "backward": dict(backward)}

    def routing_stats(self) -> Any:
        """Where the latest forward's rows went: a poise.telemetry.RoutingStats of int32 tensors on this
        context's device (a list of one per rank for a virtual-ranks context). GPU contexts write them
        on the current CUDA stream without a sync. It reads what that forward left in this context:
        call it after the forward, before a call on another layer (its backward may come between).
        Raises poise.InvalidArgument('context') before any forward."""
        self._require_open()
        stats = self._routing_stats_cpu() if self._device == "cpu" else self._routing_stats_gpu()
        return stats if self._virtual_ranks else stats[0]

    def _routing_stats_cpu(self) -> list:
        from .telemetry import stats_from_layout

        latest = self._backend.latest_routing_stats() if self._backend is not None else None
        if latest is None:
            raise InvalidArgument("context", "has run no forward yet: routing_stats describes the latest forward")
        ranks = range(self.ep_size) if self._virtual_ranks else [self.rank]
        return [stats_from_layout(latest.expert_rows, latest.owner_rows, latest.computed_rows, latest.replicas,
                                  latest.received_token_rows[r], self.config.hidden_dim) for r in ranks]

    def _routing_stats_gpu(self) -> list:
        import torch

        from .telemetry import RoutingStats

        E, R, launch = self.config.num_experts, self.ep_size, self._cpp.launch_ranks
        device = torch.device(self._device) if ":" in self._device else torch.device("cuda")
        buffer = torch.empty(launch, E + 3 * R + 1, dtype=torch.int32, device=device)
        pointers = []
        for row in buffer:
            base, size = row.data_ptr(), row.element_size()
            pointers += [base, base + E * size, base + (E + R) * size, base + (E + 2 * R) * size,
                         base + (E + 3 * R) * size]
        self._cpp.routing_stats(pointers, torch.cuda.current_stream(device).cuda_stream)
        return [RoutingStats(row[:E], row[E:E + R], row[E + R:E + 2 * R], row[E + 2 * R:E + 3 * R], row[E + 3 * R],
                             self.config.hidden_dim) for row in buffer]

    def check(self) -> None:
        """Waits for the current CUDA stream, then raises poise.DeviceError for a device-side fault of
        the calls since the last check (an expert id out of range, a capacity overflow, a peer that
        never arrived, an expert-GEMM pipeline wait past its 4 s bound). GPU calls never synchronize
        with the host, so this is where such faults surface. A CPU context raises them during the
        call: nothing to wait for."""
        self._require_open()
        if self._device == "cpu":
            return
        import torch  # a CUDA context is only used from PyTorch

        device = torch.device(self._device) if ":" in self._device else None
        _poise.context_check(self._cpp, torch.cuda.current_stream(device).cuda_stream)

    def raise_if_faulted(self) -> None:
        """Raises poise.DeviceError for a device-side fault of an earlier call that has ended on the
        device, without waiting for the stream: what every call does at its entry. For callers that
        replay captured calls as a CUDA graph, whose replay runs none of a call's host code."""
        self._require_open()
        self._cpp.raise_if_faulted()

    def reset(self) -> None:
        """Recovers after an aborted call (an exception, a device timeout). Raises once closed."""
        self._cpp.reset()
        if self._backend is not None:
            self._backend.reset()

    def close(self) -> None:
        """Releases every buffer. Collective; closing a closed context does nothing."""
        self._cpp.close()
        self._backend = None

    def _release(self) -> None:
        """close() and drop the C++ object (interpreter exit)."""
        self.close()
        self._cpp = _ClosedContext()

    def _require_open(self) -> None:
        if self.closed:
            raise InvalidArgument("context", "was closed; create a new one")

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        ranks = f"all {self.ep_size} ranks (virtual)" if self._virtual_ranks else f"rank {self.rank} of {self.ep_size}"
        return f"<poise.Context {ranks} on {self.device}, {state}>"


def _create_virtual_ranks_on_gpu(config: Config, ep_size: int, device: str) -> tuple[str, Any]:
    """The C++ virtual-ranks context, allocated now on ``device`` (its index pinned: the buffers
    live there). Returns ('cuda:N', the C++ Context)."""
    import torch  # a CUDA context is only used from PyTorch

    if not torch.cuda.is_available():
        raise DeviceError(f"create_context(virtual_ranks=True, device={device!r}): no CUDA device; "
                          "device='cpu' runs the same virtual ranks on the reference engine")
    index = int(device.partition(":")[2]) if ":" in device else torch.cuda.current_device()
    with torch.cuda.device(index):
        return f"cuda:{index}", _poise.Context.create_virtual_ranks(to_cpp(config), ep_size)


@atexit.register
def _release_live_contexts() -> None:
    """At interpreter exit, contexts still referenced (a script's globals) release their C++ state
    before the extension module goes: nothing is left for nanobind to report as leaked."""
    for context in list(_live_contexts.values()):
        context._release()


def context_from_handle(handle: int) -> Context:
    """The live Context a torch op refers to, or InvalidArgument naming 'context'."""
    context = _live_contexts.get(handle)
    if context is None:
        raise InvalidArgument("context", f"no live poise.Context has handle {handle} (was it garbage-collected?)")
    return context


def _group_size_and_rank(group: Any) -> tuple[int, int]:
    import torch.distributed as dist  # only when a group is given: `import poise` stays torch-free

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgument("group", "torch.distributed is not initialized (call init_process_group first)")
    try:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
    except (ValueError, RuntimeError, TypeError, AttributeError) as error:
        raise InvalidArgument("group", f"is not a torch.distributed process group: {error}") from None
    if rank < 0:
        raise InvalidArgument("group", "this process is not a member of the group")
    return size, rank


def create_context(
    *,
    config: Config,
    group: Any = None,
    device: object = "cuda",
    ep_size: Optional[int] = None,
    rank: Optional[int] = None,
    virtual_ranks: bool = False,
    sync_check: bool = False,
) -> Context:
    """Creates this rank's Context; every rank of the EP group calls it with the same config.

    With ``group`` (a torch.distributed group, e.g. ``dist.group.WORLD``), ep_size and rank are the
    group's (passing them too is allowed if they agree). Without a group: ``ep_size`` (default 1)
    and ``rank`` (default 0). ``device``: 'cuda' / 'cuda:N' / a torch.device for the GPU engine,
    'cpu' for the CPU reference engine.

    ``virtual_ranks=True``: one context for all ``ep_size`` ranks in this process (no group, no
    rank), called through poise.routed_experts_virtual with one tensor per rank. On a GPU the ranks
    share that device (the C++ Context::create_virtual_ranks, which allocates now); on the CPU they
    run the reference engine. For tests, development and single-GPU benchmarks.

    ``sync_check=True``: every call on this context checks for device faults in the call (as
    ``ExecutionOptions(sync_check=True)`` does per call): for hunting a bad batch.
    """
    if not isinstance(virtual_ranks, bool):
        raise InvalidArgument("virtual_ranks", f"must be a bool, got {type(virtual_ranks).__name__}")
    if virtual_ranks:
        if group is not None:
            raise InvalidArgument("group", "a virtual-ranks context runs every rank in this process: pass no group")
        if rank is not None:
            raise InvalidArgument("rank", "a virtual-ranks context drives every rank: pass no rank")
        return Context(config, ep_size=1 if ep_size is None else ep_size, rank=0, device=device,
                       virtual_ranks=True, sync_check=sync_check)
    if group is not None:
        group_size, group_rank = _group_size_and_rank(group)
        if ep_size is not None and as_index("ep_size", ep_size) != group_size:
            raise InvalidArgument("ep_size", f"is {ep_size} but the group has {group_size} ranks")
        if rank is not None and as_index("rank", rank) != group_rank:
            raise InvalidArgument("rank", f"is {rank} but this process is rank {group_rank} of the group")
        ep_size, rank = group_size, group_rank
    context = Context(config, ep_size=1 if ep_size is None else ep_size, rank=0 if rank is None else rank,
                      device=device, group=group, sync_check=sync_check)
    if group is not None and context.device != "cpu":  # one process per GPU: NCCL (needs libnccl)
        from .nccl_context import attach_nccl_communicator

        attach_nccl_communicator(context, group)
    return context
