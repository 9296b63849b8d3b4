"""poise.plan_memory: every C++ MemoryPlan field, numbers that add up, explain() covering each region."""

import dataclasses
import itertools

import pytest

import poise

BASE = dict(num_local_input_tokens=1024, hidden_dim=2048, intermediate_dim=768, top_k=8, num_experts=64)
EP_SIZE = 8

REGIONS = [  # (field, label that explain() prints for it)
    ("communication_bytes", "communication window"),
    ("replica_weight_bytes", "replica experts"),
    ("activation_slot_bytes", "activation slot (each)"),
    ("activation_slots_total_bytes", "activation slots (all)"),
    ("device_scratch_bytes", "device scratch"),
    ("host_overflow_scratch_bytes", "host overflow scratch"),
    ("total_device_bytes", "total device"),
    ("total_virtual_bytes", "total virtual"),
]

# A spread of configurations: training and inference, both balance modes, host overflow on and off,
# odd dims (multiples of 64 but not 128), slot sizing by factor and by bytes.
VARIANTS = [
    dict(),
    dict(inference=True),
    dict(balance="capacity", receive_capacity_factor=1.5),
    dict(balance="capacity", receive_capacity_factor=3.0),
    dict(balance="capacity", receive_capacity_factor=3.0,
         num_activation_slots=3, max_moe_layers_per_activation_slot=2),
    dict(hidden_dim=64 * 15, intermediate_dim=64 * 7, top_k=1),
    dict(activation_slot_capacity_factor=0.25, wgrad_dtype="bf16"),
    dict(activation_slot_capacity_factor=0.0),
    dict(num_activation_slots=0),
    dict(activation="swiglu_clamped", num_experts=8, top_k=8),
    dict(balance_cost_ns_per_row=414.0, balance_cost_ns_per_group=4.66e4, balance_link_gb_per_s=385.0),
]


def plan(ep_size=EP_SIZE, **changes) -> poise.MemoryPlan:
    return poise.plan_memory(poise.Config(**{**BASE, **changes}), ep_size)


def numbers(p: poise.MemoryPlan) -> dict:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in ("config", "_explanation")}


def test_every_cpp_field_is_an_attribute(cpp_fields):
    python_fields = [f.name for f in dataclasses.fields(poise.MemoryPlan) if f.name != "_explanation"]
    assert python_fields == cpp_fields("memory_plan.hpp", "MemoryPlan")
    p = plan()
    for name, value in numbers(p).items():
        assert type(value) is int, name
        assert value >= 0, name


def test_the_cost_aware_plan_sizes_rows_for_capacity_mode_and_says_so():
    """With the cost-aware rates the receive rows hold receive_capacity_factor * T*K (the largest row
    limit the plan may choose), and explain() names the rates and the limits."""
    exact = plan()
    cost = plan(balance_cost_ns_per_row=414.0, balance_link_gb_per_s=385.0, receive_capacity_factor=1.5)
    routed = BASE["num_local_input_tokens"] * BASE["top_k"]
    assert cost.balanced_rows >= int(1.5 * routed) > exact.balanced_rows
    assert cost.device_rows > exact.device_rows
    assert f"cost-aware, row limits {routed} (exact) to {int(1.5 * routed)}" in cost.explain()
    assert "cost-aware" not in exact.explain()


def test_the_plan_carries_its_config_and_ep_size():
    config = poise.Config(**BASE, balance="capacity")
    p = poise.plan_memory(config, 4)
    assert p.config == config
    assert p.ep_size == 4
    assert p.num_local_experts == BASE["num_experts"] // 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.total_device_bytes = 0


@pytest.mark.parametrize("changes", VARIANTS, ids=[str(i) for i in range(len(VARIANTS))])
@pytest.mark.parametrize("ep_size", [1, 8])
def test_regions_sum_to_the_totals(changes, ep_size):
    p = plan(ep_size, **changes)
    assert p.total_device_bytes == (
        p.communication_bytes + p.replica_weight_bytes + p.activation_slots_total_bytes + p.device_scratch_bytes
    )
    assert p.total_virtual_bytes == p.total_device_bytes + p.host_overflow_scratch_bytes
    assert p.activation_slots_total_bytes == p.config.num_activation_slots * p.activation_slot_bytes
    # Rows: the balanced rows cover T*K, padded to whole tiles; host rows only exist with a host factor.
    T, K = p.config.num_local_input_tokens, p.config.top_k
    assert p.balanced_rows >= T * K
    assert p.balanced_rows % 128 == 0
    assert p.balanced_rows <= p.device_rows or p.config.balance == "capacity"
    assert p.device_rows <= p.total_rows
    assert (p.total_rows > p.device_rows) == (p.host_overflow_scratch_bytes > 0)
    if p.config.host_overflow_scratch_factor == 0:
        assert p.total_rows == p.device_rows
    # Slot sizes are ordered: routing layout only <= full save at balance <= full save of every row.
    if not p.config.inference:
        assert 0 < p.activation_slot_min_bytes <= p.activation_slot_full_save_bytes
        assert p.activation_slot_full_save_bytes <= p.activation_slot_max_useful_bytes
        # A slot keeps whole layers: 0..max_moe_layers_per_activation_slot records.
        assert 0 <= p.activation_slot_bytes <= p.activation_slot_max_useful_bytes
        assert 0 <= p.activation_records_per_slot <= p.config.max_moe_layers_per_activation_slot
        assert p.activation_slot_bytes == (p.activation_records_per_slot * p.activation_record_bytes
                                           + p.activation_light_records_per_slot * p.activation_light_record_bytes
                                           + p.activation_partial_record_bytes)
        assert p.activation_partial_record_rows % 128 == 0
        assert p.activation_records_per_slot + p.activation_light_records_per_slot <= \
            p.config.max_moe_layers_per_activation_slot
        assert p.activation_light_record_bytes < p.activation_record_bytes


def test_inference_saves_nothing_and_keeps_no_weight_grads():
    training, inference = plan(), plan(inference=True)
    for field in ("activation_slot_min_bytes", "activation_slot_full_save_bytes",
                  "activation_slot_max_useful_bytes", "activation_slot_bytes", "activation_slots_total_bytes"):
        assert getattr(inference, field) == 0, field
    assert inference.replica_weight_bytes < training.replica_weight_bytes
    assert inference.device_scratch_bytes <= training.device_scratch_bytes
    assert inference.total_device_bytes < training.total_device_bytes


@pytest.mark.parametrize("changes", VARIANTS, ids=[str(i) for i in range(len(VARIANTS))])
def test_every_size_is_monotone_in_tokens(changes):
    plans = [plan(**{**changes, "num_local_input_tokens": t}) for t in (1, 7, 128, 1000, 4096, 4097, 16384)]
    for smaller, larger in itertools.pairwise(plans):
        for name, value in numbers(smaller).items():
            if name.endswith("_bytes") or name.endswith("_rows"):
                assert numbers(larger)[name] >= value, name
        assert larger.balanced_rows >= smaller.balanced_rows
    assert plans[-1].total_device_bytes > plans[0].total_device_bytes


def test_slots_scale_with_num_activation_slots():
    plans = {n: plan(num_activation_slots=n) for n in range(5)}
    slot = plans[1].activation_slot_bytes
    assert slot > 0
    for n, p in plans.items():
        assert p.activation_slot_bytes == slot
        assert p.activation_slots_total_bytes == n * slot
        assert p.total_device_bytes == plans[0].total_device_bytes + n * slot
        assert p.device_scratch_bytes == plans[0].device_scratch_bytes


def test_layers_per_slot_scale_the_slot():
    one, three = plan(max_moe_layers_per_activation_slot=1), plan(max_moe_layers_per_activation_slot=3)
    assert three.activation_slot_min_bytes == 3 * one.activation_slot_min_bytes
    assert three.activation_slot_full_save_bytes == 3 * one.activation_slot_full_save_bytes


def test_slot_sizing_by_factor_and_by_bytes():
    # A slot for 4 layers keeps as many whole layers as its bytes allow; the others recompute.
    full = plan(max_moe_layers_per_activation_slot=4)
    half = plan(max_moe_layers_per_activation_slot=4, activation_slot_capacity_factor=0.5)
    none = plan(max_moe_layers_per_activation_slot=4, activation_slot_capacity_factor=0.0)
    assert (none.activation_records_per_slot, half.activation_records_per_slot, full.activation_records_per_slot) == (0, 2, 4)
    assert none.activation_slot_bytes == 0 < half.activation_slot_bytes < full.activation_slot_bytes
    assert full.activation_slot_bytes == 4 * full.activation_record_bytes == full.activation_slot_max_useful_bytes
    assert full.activation_light_records_per_slot == 0
    # An absolute size keeps the whole records that fit in it, then light ones (no x rows) in the rest.
    whole, light = full.activation_record_bytes, full.activation_light_record_bytes
    sized = plan(max_moe_layers_per_activation_slot=4, activation_slot_bytes=2 * whole + light + light // 2)
    assert (sized.activation_records_per_slot, sized.activation_light_records_per_slot) == (2, 1)
    # ... and what is left keeps the first rows of one more layer (whole 128-row blocks of h13).
    assert 0 < sized.activation_partial_record_rows < sized.balanced_rows
    assert sized.activation_slot_bytes == 2 * whole + light + sized.activation_partial_record_bytes <= 2 * whole + light + light // 2
    # Beyond the useful maximum it is clamped; below the minimum it is an error naming the field.
    huge = plan(activation_slot_bytes=10 * full.activation_slot_max_useful_bytes)
    assert huge.activation_slot_bytes == plan().activation_slot_max_useful_bytes
    with pytest.raises(poise.InvalidArgument) as raised:
        plan(activation_slot_bytes=plan().activation_slot_min_bytes - 1)
    assert raised.value.name == "activation_slot_bytes"


def test_more_ranks_mean_fewer_local_experts():
    assert plan(1).num_local_experts == BASE["num_experts"]
    assert plan(8).num_local_experts == BASE["num_experts"] // 8
    assert plan(1).num_replica_slots == 0  # one rank has nobody to lend rows to
    assert plan(1).replica_weight_bytes == 0
    assert plan(8).replica_weight_bytes < plan(2).replica_weight_bytes


@pytest.mark.parametrize("changes", VARIANTS, ids=[str(i) for i in range(len(VARIANTS))])
def test_explain_mentions_each_region(changes):
    p = plan(**changes)
    text = p.explain()
    for field, label in REGIONS:
        if p.config.inference and field.startswith("activation_slot"):
            assert label not in text  # inference has no activation slots
        else:
            assert label in text, label
    assert f"EP={p.ep_size}" in text
    assert f"T={p.config.num_local_input_tokens}" in text
    assert f"balanced {p.balanced_rows}" in text


def test_repr_names_the_shape_and_the_totals():
    p = plan()
    text = repr(p)
    assert text.startswith("MemoryPlan(")
    assert f"ep_size={EP_SIZE}" in text and f"D={BASE['hidden_dim']}" in text
    assert f"{p.total_device_bytes / 2**30:.3f} GiB" in text
    assert "_explanation" not in text


def test_plans_compare_by_value():
    assert plan() == plan()
    assert plan() != plan(num_activation_slots=2)


def test_capacity_mode_plans_every_received_row_on_the_device():
    """The pipeline keeps the scratch of every row the dispatch accepts on the device (host-backed
    overflow rows are not built), so the plan counts every receive row."""
    config = poise.Config(**{**BASE, "balance": "capacity", "receive_capacity_factor": 2.0})
    p = poise.plan_memory(config, EP_SIZE)
    T, K = config.num_local_input_tokens, config.top_k
    padding = config.num_experts // EP_SIZE * 127
    assert p.device_rows == p.total_rows == (2 * T * K + padding + 127) // 128 * 128
    assert p.device_rows > p.balanced_rows
    assert p.host_overflow_scratch_bytes == 0
    with pytest.raises(poise.NotAvailable, match="host_overflow_scratch_factor"):
        poise.plan_memory(dataclasses.replace(config, host_overflow_scratch_factor=0.5), EP_SIZE)


@pytest.mark.parametrize("changes", [dict(), dict(inference=True),
                                     dict(balance="capacity", receive_capacity_factor=3.0),
                                     dict(hidden_dim=64 * 15, intermediate_dim=64 * 7, top_k=1)],
                         ids=["training", "inference", "capacity", "odd_dims"])
@pytest.mark.parametrize("fp8_wgrad", [False, True])
@pytest.mark.parametrize("ep_size", [1, 8])
def test_fp8_plans_its_operands_in_device_scratch(changes, ep_size, fp8_wgrad):
    """gemm_precision='fp8_block_scaled': the call's FP8 operands (e4m3 tokens and a of every device
    row, every expert group's W13 and W2, fp32 scales per 128 of K, each region padded to 256 bytes)
    are device scratch on top of the BF16 plan's, and fp8_operand_bytes says how much; 0 in bf16. A
    training context's also: the backward's row tiles of gradient rows, and for its WGRAD the device
    rows of x in bf16 (BF16 WGRAD) or (fp8_wgrad) column tiles of gradient and activation rows.
    The x rows cross the wire (and are kept in activation records) in FP8 with their scales, so the
    window and the activation slots shrink."""
    bf16 = plan(ep_size, **changes)
    fp8 = plan(ep_size, **changes, gemm_precision="fp8_block_scaled", fp8_wgrad=fp8_wgrad)
    assert bf16.fp8_operand_bytes == 0
    assert fp8.fp8_operand_bytes > 0
    assert fp8.device_rows == bf16.device_rows and fp8.num_replica_slots == bf16.num_replica_slots
    assert fp8.device_scratch_bytes - bf16.device_scratch_bytes == fp8.fp8_operand_bytes
    D, F, T = fp8.config.hidden_dim, fp8.config.intermediate_dim, fp8.config.num_local_input_tokens
    groups = fp8.num_local_experts + fp8.num_replica_slots

    def blocks(n):
        return -(-n // 128)

    assert (fp8.x_row_wire_bytes, bf16.x_row_wire_bytes) == (D + 4 * blocks(D), 2 * D)
    assert fp8.communication_bytes <= bf16.communication_bytes
    assert fp8.activation_slots_total_bytes <= bf16.activation_slots_total_bytes
    values = T * D + fp8.device_rows * F + groups * 3 * F * D
    scales = 4 * (T * blocks(D) + fp8.device_rows * blocks(F)
                  + groups * (blocks(2 * F) * blocks(D) + blocks(D) * blocks(F)))
    if not fp8.config.inference:  # the backward's row / column tiles of gradients and activations
        rows = fp8.device_rows
        for cols in (max(D, 2 * F), max(F, D)) if fp8_wgrad else (max(D, 2 * F),):
            values += rows * cols
            scales += 4 * max(rows * blocks(cols), rows // 128 * cols)
        if not fp8_wgrad:
            values += rows * 2 * D  # x's rows dequantized to bf16
    assert values + scales <= fp8.fp8_operand_bytes < values + scales + 12 * 256
    assert "of which FP8 operands" in fp8.explain()
    if not fp8.config.inference:
        assert ("max(F, D)" if fp8_wgrad else "for the BF16 WGRAD") in fp8.explain()
    if fp8_wgrad:  # FP8 WGRAD needs the FP8 GEMMs
        with pytest.raises(poise.InvalidArgument, match="fp8_wgrad"):
            poise.Config(**{**dataclasses.asdict(fp8.config), "gemm_precision": "bf16"})
    assert "FP8" not in bf16.explain()


@pytest.mark.parametrize("ep_size", [1, 8])
def test_prepared_fp8_weights_drop_the_own_experts_weight_scratch(ep_size):
    """prepared_fp8_weights=True: every forward brings the local experts' prepared FP8 weights, so an
    inference plan holds scratch for the replica slots' weights only; it needs fp8_block_scaled."""
    per_call = plan(ep_size, gemm_precision="fp8_block_scaled", inference=True)
    lean = plan(ep_size, gemm_precision="fp8_block_scaled", prepared_fp8_weights=True, inference=True)
    # A training context keeps the scratch: its backward writes the weights' transposed copies there.
    training = plan(ep_size, gemm_precision="fp8_block_scaled", prepared_fp8_weights=True)
    assert training.fp8_operand_bytes == plan(ep_size, gemm_precision="fp8_block_scaled").fp8_operand_bytes
    D, F = lean.config.hidden_dim, lean.config.intermediate_dim
    own = lean.num_local_experts
    blocks = lambda n: -(-n // 128)  # noqa: E731
    own_weights = own * (3 * F * D + 4 * (blocks(2 * F) * blocks(D) + blocks(D) * blocks(F)))
    saved = per_call.fp8_operand_bytes - lean.fp8_operand_bytes
    assert own_weights <= saved < own_weights + 4 * 256
    assert per_call.total_device_bytes - lean.total_device_bytes == saved
    assert "the own experts' come prepared" in lean.explain()
    with pytest.raises(poise.InvalidArgument, match="prepared_fp8_weights"):
        poise.Config(**{**dataclasses.asdict(lean.config), "gemm_precision": "bf16"})
