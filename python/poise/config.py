"""poise.Config: the static description of one MoE layer's routed experts across an EP group.

The field names, defaults and meanings are those of the C++ ``poise::Config``
(include/poise/config.hpp). A Config is checked when it is built (and rebuilt by
``dataclasses.replace``): each field's Python type here, every rule that holds for any EP size by the
C++ ``Config::validate`` (the one source of truth), reached through ``to_cpp`` below, the one place
where a Python Config becomes a C++ one. The rules that need the EP size run on use
(``validate(ep_size)``, ``plan_memory``, ``create_context``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from . import _poise
from .errors import InvalidArgument, as_index

Activation = Literal["swiglu", "swiglu_clamped"]
Balance = Literal["exact", "capacity"]
GemmPrecision = Literal["bf16", "fp8_block_scaled"]
WgradDType = Literal["fp32", "bf16", "float32", "bfloat16"]


@dataclasses.dataclass(kw_only=True)
class Config:
    """One MoE layer's routed experts: shapes, balance, activation slots, scratch sizes.

    Building one with a bad field raises ``poise.InvalidArgument`` naming it (a bool is no integer);
    ``validate(ep_size)``, ``plan_memory`` and ``create_context`` add the rules of the EP size.
    """

    num_local_input_tokens: int
    """T: physical rows per rank and call (padding rows carry zero scores)."""
    hidden_dim: int
    """D: a multiple of 64."""
    intermediate_dim: int
    """F: a multiple of 64."""
    top_k: int
    """K: experts per token, at most num_experts."""
    num_experts: int
    """E: divisible by the EP size."""

    activation: Activation = "swiglu"
    """'swiglu': silu(g) * u; 'swiglu_clamped': the gpt-oss form, uses swiglu_alpha and swiglu_limit."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    balance: Balance = "exact"
    """'exact': every rank computes T*K rows (hot experts replicated); 'capacity': dropless up to a factor."""
    balance_tolerance: float = 0.0
    """Exact mode: a rank may compute up to (1 + tolerance) * T*K rows; only rows beyond move. 0 = exact."""
    receive_capacity_factor: float = 2.0
    """Capacity mode: a rank receives up to factor * T*K rows (also the cost-aware plan's largest row limit)."""
    balance_cost_ns_per_row: float = 0.0
    """Exact mode, cost-aware plan (docs/balance.md): with this and balance_link_gb_per_s > 0, each call's
    planner tries row limits from T*K (exact balance) to max(receive_capacity_factor, 1 + balance_tolerance)
    * T*K (capacity mode) and keeps the plan of least predicted time: the slowest rank's computed rows x
    this (forward + backward expert work per row) + its expert groups x balance_cost_ns_per_group, plus the
    busiest link's replica bytes (weights out, gradients back) / balance_link_gb_per_s. 0: plain exact balance."""
    balance_cost_ns_per_group: float = 0.0
    """Cost-aware plan: expert work per expert group a rank computes (own expert with rows, or replica)."""
    balance_link_gb_per_s: float = 0.0
    """Cost-aware plan: one rank's link rate, one direction, GB/s (NVLink on an H200: about 450)."""

    num_activation_slots: int = 1
    """Where forward keeps what backward needs; each slot serves max_moe_layers_per_activation_slot layers."""
    max_moe_layers_per_activation_slot: int = 1
    activation_slot_capacity_factor: Optional[float] = None
    """Slot size as a multiple of the balanced full-save bytes (set this or activation_slot_bytes)."""
    activation_slot_bytes: Optional[int] = None
    """Slot size in bytes (set this or activation_slot_capacity_factor)."""

    host_overflow_scratch_factor: float = 0.0
    """Host-backed (VMM) overflow rows = factor * balanced rows."""

    gemm_precision: GemmPrecision = "bf16"
    """'bf16', or 'fp8_block_scaled': E4M3 operands with DeepSeek-V3 block scales (docs/fp8.md). Every GEMM
    of forward and backward (DGRAD and WGRAD) runs in FP8, on the GPU and in the CPU reference engine."""

    prepared_fp8_weights: bool = False
    """With gemm_precision='fp8_block_scaled': every forward passes the local experts' weights as
    poise.prepare_weights quantized them (``prepared=``), and a forward without them raises
    InvalidArgument naming ``prepared``. An inference context then holds no scratch to quantize them
    into per call (3 * intermediate_dim * hidden_dim bytes and their scales per local expert: 1.4 GB
    at a DeepSeek-V3 EP8 rank); a training context keeps it for the backward's transposed copies."""

    fp8_wgrad: bool = False
    """With gemm_precision='fp8_block_scaled': the weight gradients' GEMMs in FP8 too (DeepSeek-V3's
    recipe). False: WGRAD in BF16 on the bf16 gradient rows and x's FP8 rows dequantized, faster on
    the H200 and closer to BF16 (docs/fp8.md); FPROP and DGRAD run in FP8 either way."""

    wgrad_dtype: WgradDType = "fp32"
    """Weight-gradient dtype: 'fp32' or 'bf16' ('float32', 'bfloat16' and torch dtypes are accepted)."""
    replica_grad_dtype: WgradDType = "bf16"
    """Exact balance, training: the dtype in which a replica's weight gradients travel back to their owner
    (bf16 halves the link bytes; the owner adds them in fp32), or 'fp32' (the replica's sums as computed)."""
    inference: bool = False
    """No backward: no activation slots, no weight-gradient buffers."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_type(field.name, field.type, getattr(self, field.name))
        to_cpp(self).validate(1)  # every rule that holds for any EP size

    def validate(self, ep_size: int) -> None:
        """Raises poise.InvalidArgument (with ``.name``) if this Config cannot run on ep_size ranks."""
        to_cpp(self).validate(as_index("ep_size", ep_size))


def _check_type(name: str, annotation: str, value: object) -> None:
    """bool is an int subclass and nanobind converts it: name it here, as C++ would a wrong type."""
    if isinstance(value, bool) and annotation != "bool":
        raise InvalidArgument(name, f"must be {annotation}, got bool {value!r}")
    if annotation == "bool" and not isinstance(value, bool):
        raise InvalidArgument(name, f"must be bool, got {type(value).__name__} {value!r}")


def _dtype_name(value: object) -> object:
    """'bf16', 'bfloat16', torch.bfloat16 and 'torch.bfloat16' all name the same dtype for C++."""
    name = value if isinstance(value, str) else str(value)
    return name.removeprefix("torch.")


def _type_rule(expected: str, value: object) -> str:
    if type(value) is int:  # the right type, but C++ stores it in 64 bits
        return f"must fit in a signed 64-bit integer, got {value}"
    return f"must be {expected}, got {type(value).__name__} {value!r}"


def to_cpp(config: Config) -> _poise.Config:
    """The one conversion Python Config -> C++ Config. Enum strings are parsed by C++."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a poise.Config, got {type(config).__name__}")
    cpp = _poise.Config()
    for field in dataclasses.fields(Config):
        value = getattr(config, field.name)
        if field.name in ("wgrad_dtype", "replica_grad_dtype"):
            value = _dtype_name(value)
        try:
            setattr(cpp, field.name, value)
        except TypeError:
            raise InvalidArgument(field.name, _type_rule(field.type, value)) from None
    return cpp


def from_cpp(cpp: _poise.Config) -> Config:
    """C++ Config -> Python Config (enum fields come back in their canonical spelling)."""
    return Config(**{field.name: getattr(cpp, field.name) for field in dataclasses.fields(Config)})
