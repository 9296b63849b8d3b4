"""poise.plan_memory: sizes every region a Context will own. Pure host arithmetic, no GPU needed."""

from __future__ import annotations

import dataclasses

from . import _poise
from .config import Config, from_cpp, to_cpp
from .errors import as_index


@dataclasses.dataclass(frozen=True, repr=False)
class MemoryPlan:
    """The C++ poise::MemoryPlan: rows per call and bytes per region, per rank.

    ``total_device_bytes`` = communication + replica weights + all activation slots + device scratch;
    ``total_virtual_bytes`` adds the host-backed overflow scratch. ``explain()`` shows each rule.
    """

    config: Config
    ep_size: int
    num_local_experts: int
    """E / ep_size."""
    num_replica_slots: int
    """B: replica expert slots per rank (exact balance)."""

    balanced_rows: int
    """T*K + per-expert padding: the rows exact balance guarantees per rank."""
    device_rows: int
    """Rows the device receive buffers and scratch hold."""
    total_rows: int
    """Device rows + host-backed overflow rows."""

    communication_bytes: int
    """Symmetric window: dispatch receive, combine, signals."""
    replica_weight_bytes: int
    """B replica experts' weights (+ fp32 grads in training)."""
    activation_slot_min_bytes: int
    """Per slot: routing layout only, everything recomputed."""
    activation_slot_full_save_bytes: int
    """Per slot: saves all of backward's inputs at balance."""
    activation_slot_max_useful_bytes: int
    """Per slot: full save when every row is on the device."""
    activation_slot_bytes: int
    """Per slot, as configured: its whole and light records."""
    activation_record_bytes: int
    """One layer's forward kept whole: routing layout, x rows and h13 of every received row."""
    activation_records_per_slot: int
    """Layers a slot keeps whole."""
    activation_light_record_bytes: int
    """One layer kept without its x rows (routing layout and h13): backward dispatches x again."""
    activation_light_records_per_slot: int
    """Layers a slot keeps light, after the whole ones."""
    activation_partial_record_rows: int
    """One more layer per slot keeps h13 of this many rows (0: none); backward recomputes the rest."""
    activation_partial_record_bytes: int
    """That partial layer's bytes (routing layout and h13 of its first rows)."""
    activation_slots_total_bytes: int
    """num_activation_slots * activation_slot_bytes."""
    device_scratch_bytes: int
    """Per-call intermediates (h13, a, grads) on the device."""
    fp8_operand_bytes: int
    """Of device scratch, gemm_precision='fp8_block_scaled': the call's FP8 operands (e4m3 tokens and a
    rows, every expert group's weights, their scales); 0 in bf16."""
    x_row_wire_bytes: int
    """Bytes one x row carries to an expert's rank: 2 * hidden_dim in bf16; in fp8_block_scaled the
    tokens are quantized once before dispatch and a row carries hidden_dim e4m3 values and
    4 * ceil(hidden_dim / 128) bytes of fp32 scales (0.52x at hidden_dim 7168)."""
    host_overflow_scratch_bytes: int
    """Host-backed virtual memory for overflow rows."""
    total_device_bytes: int
    total_virtual_bytes: int

    # explain()'s text, formatted by C++ once: no C++ object outlives the conversion (one alive at
    # interpreter exit would be reported as a leak).
    _explanation: str = dataclasses.field(compare=False, repr=False)

    def explain(self) -> str:
        """One line per region, sizes in MiB/GiB, with the rule that sized it (formatted by C++)."""
        return self._explanation

    def __repr__(self) -> str:
        c = self.config
        return (
            f"MemoryPlan(ep_size={self.ep_size}, T={c.num_local_input_tokens}, D={c.hidden_dim}, "
            f"F={c.intermediate_dim}, E={c.num_experts}, K={c.top_k}, "
            f"total_device={_gib(self.total_device_bytes)}, total_virtual={_gib(self.total_virtual_bytes)})"
        )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"


def plan_from_cpp(cpp: _poise.MemoryPlan) -> MemoryPlan:
    numbers = {
        field.name: getattr(cpp, field.name)
        for field in dataclasses.fields(MemoryPlan)
        if field.name not in ("config", "_explanation")
    }
    return MemoryPlan(config=from_cpp(cpp.config), _explanation=cpp.explain(), **numbers)


def plan_memory(config: Config, ep_size: int) -> MemoryPlan:
    """Validates config for ep_size (poise.InvalidArgument) and sizes every region, per rank.

    Pure host arithmetic: no CUDA, no GPU needed. A Context created with the same arguments owns
    exactly this plan (``context.plan``).
    """
    return plan_from_cpp(_poise.plan_memory(to_cpp(config), as_index("ep_size", ep_size)))
