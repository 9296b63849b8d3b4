"""poise.Config mirrors the C++ Config: same fields, same defaults, C++ validation with named errors,
checked when built (the rules of the EP size on use)."""

import dataclasses
import math
import pickle

import pytest

import poise
from poise import _poise
from poise.config import from_cpp, to_cpp

VALID = dict(num_local_input_tokens=512, hidden_dim=1024, intermediate_dim=512, top_k=4, num_experts=16)
EP_SIZE = 4


def make(**changes) -> poise.Config:
    return poise.Config(**{**VALID, **changes})


def test_field_names_are_the_cpp_ones_in_order(cpp_fields):
    assert [f.name for f in dataclasses.fields(poise.Config)] == cpp_fields("config.hpp", "Config")


def test_defaults_equal_the_cpp_defaults():
    cpp_default = _poise.Config()  # the C++ default constructor
    python_default = make()  # the shape fields have no default
    for field in dataclasses.fields(poise.Config):
        if field.name not in VALID:
            assert getattr(python_default, field.name) == getattr(cpp_default, field.name), field.name
    # And the conversion is the identity both ways.
    assert from_cpp(to_cpp(python_default)) == python_default


def test_the_shape_fields_are_required():
    with pytest.raises(TypeError, match="num_local_input_tokens"):
        poise.Config(hidden_dim=1024, intermediate_dim=512, top_k=4, num_experts=16)


def test_round_trip_of_every_field_through_cpp():
    config = make(
        activation="swiglu_clamped", swiglu_alpha=1.5, swiglu_limit=9.0, balance="capacity",
        receive_capacity_factor=1.25, num_activation_slots=3, max_moe_layers_per_activation_slot=2,
        activation_slot_bytes=12345, host_overflow_scratch_factor=0.5,
        wgrad_dtype="bf16", inference=False,
    )
    assert from_cpp(to_cpp(config)) == config
    other = make(activation_slot_capacity_factor=0.75)
    assert from_cpp(to_cpp(other)).activation_slot_capacity_factor == 0.75
    cost_aware = make(balance_cost_ns_per_row=414.0, balance_cost_ns_per_group=4.66e4, balance_link_gb_per_s=385.0)
    assert from_cpp(to_cpp(cost_aware)) == cost_aware


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16"])
def test_wgrad_dtype_accepts_torch_style_names(spelling):
    assert to_cpp(make(wgrad_dtype=spelling)).wgrad_dtype == "bf16"


def test_wgrad_dtype_accepts_dtype_like_objects():
    class FakeTorchDtype:  # str(torch.float32) == "torch.float32"
        def __str__(self):
            return "torch.float32"

    assert to_cpp(make(wgrad_dtype=FakeTorchDtype())).wgrad_dtype == "fp32"


def test_a_valid_config_validates():
    make().validate(EP_SIZE)
    make(hidden_dim=64 * 17, intermediate_dim=64 * 3).validate(EP_SIZE)  # multiples of 64, not of 128
    make(top_k=VALID["num_experts"]).validate(EP_SIZE)  # every expert chosen
    make(num_activation_slots=0).validate(EP_SIZE)
    make(activation_slot_bytes=0).validate(EP_SIZE)
    make(activation_slot_capacity_factor=0.0).validate(EP_SIZE)
    make(activation="swiglu", swiglu_alpha=0.0).validate(EP_SIZE)  # alpha only matters when clamped
    make(balance="exact", receive_capacity_factor=0.5).validate(EP_SIZE)  # only matters in capacity mode


# (field changes, ep_size, the name InvalidArgument must carry)
RULES = [
    (dict(), 0, "ep_size"),
    (dict(), -2, "ep_size"),
    (dict(num_local_input_tokens=0), EP_SIZE, "num_local_input_tokens"),
    (dict(num_local_input_tokens=-1), EP_SIZE, "num_local_input_tokens"),
    (dict(hidden_dim=0), EP_SIZE, "hidden_dim"),
    (dict(hidden_dim=-64), EP_SIZE, "hidden_dim"),
    (dict(hidden_dim=1000), EP_SIZE, "hidden_dim"),
    (dict(hidden_dim=32), EP_SIZE, "hidden_dim"),
    (dict(intermediate_dim=0), EP_SIZE, "intermediate_dim"),
    (dict(intermediate_dim=96), EP_SIZE, "intermediate_dim"),
    (dict(top_k=0), EP_SIZE, "top_k"),
    (dict(top_k=-1), EP_SIZE, "top_k"),
    (dict(top_k=17), EP_SIZE, "top_k"),
    (dict(num_experts=0), EP_SIZE, "num_experts"),
    (dict(num_experts=18, top_k=2), EP_SIZE, "num_experts"),
    (dict(), 3, "num_experts"),
    (dict(activation="relu"), EP_SIZE, "activation"),
    (dict(activation="SwiGLU"), EP_SIZE, "activation"),
    (dict(activation="swiglu_clamped", swiglu_alpha=0.0), EP_SIZE, "swiglu_alpha"),
    (dict(activation="swiglu_clamped", swiglu_alpha=math.nan), EP_SIZE, "swiglu_alpha"),
    (dict(activation="swiglu_clamped", swiglu_limit=-7.0), EP_SIZE, "swiglu_limit"),
    (dict(activation="swiglu_clamped", swiglu_limit=math.inf), EP_SIZE, "swiglu_limit"),
    (dict(balance="balanced"), EP_SIZE, "balance"),
    (dict(balance_tolerance=-0.1), EP_SIZE, "balance_tolerance"),
    (dict(balance_tolerance=math.inf), EP_SIZE, "balance_tolerance"),
    (dict(balance="capacity", receive_capacity_factor=0.5), EP_SIZE, "receive_capacity_factor"),
    (dict(balance="capacity", receive_capacity_factor=math.nan), EP_SIZE, "receive_capacity_factor"),
    (dict(balance_cost_ns_per_row=-1.0), EP_SIZE, "balance_cost_ns_per_row"),
    (dict(balance_cost_ns_per_group=math.nan), EP_SIZE, "balance_cost_ns_per_group"),
    (dict(balance_link_gb_per_s=math.inf), EP_SIZE, "balance_link_gb_per_s"),
    (dict(balance_cost_ns_per_row=400.0), EP_SIZE, "balance_link_gb_per_s"),
    (dict(balance_link_gb_per_s=450.0), EP_SIZE, "balance_cost_ns_per_row"),
    (dict(balance="capacity", balance_cost_ns_per_row=400.0, balance_link_gb_per_s=450.0), EP_SIZE,
     "balance_cost_ns_per_row"),
    (dict(balance_cost_ns_per_row=400.0, balance_link_gb_per_s=450.0, receive_capacity_factor=0.5), EP_SIZE,
     "receive_capacity_factor"),
    (dict(num_activation_slots=-1), EP_SIZE, "num_activation_slots"),
    (dict(max_moe_layers_per_activation_slot=0), EP_SIZE, "max_moe_layers_per_activation_slot"),
    (dict(activation_slot_capacity_factor=1.0, activation_slot_bytes=1 << 20), EP_SIZE, "activation_slot_bytes"),
    (dict(activation_slot_capacity_factor=-0.5), EP_SIZE, "activation_slot_capacity_factor"),
    (dict(activation_slot_capacity_factor=math.inf), EP_SIZE, "activation_slot_capacity_factor"),
    (dict(activation_slot_bytes=-1), EP_SIZE, "activation_slot_bytes"),
    (dict(host_overflow_scratch_factor=-0.25), EP_SIZE, "host_overflow_scratch_factor"),
    (dict(inference=True, activation_slot_bytes=1 << 20), EP_SIZE, "activation_slot_bytes"),
    (dict(inference=True, activation_slot_capacity_factor=1.0), EP_SIZE, "activation_slot_bytes"),
    (dict(wgrad_dtype="fp16"), EP_SIZE, "wgrad_dtype"),
    (dict(wgrad_dtype="torch.float16"), EP_SIZE, "wgrad_dtype"),
    (dict(replica_grad_dtype="fp16"), EP_SIZE, "replica_grad_dtype"),
    # Wrong Python types are named too (caught while converting to the C++ struct).
    (dict(hidden_dim=1024.0), EP_SIZE, "hidden_dim"),
    (dict(top_k="4"), EP_SIZE, "top_k"),
    (dict(num_experts=2**64), EP_SIZE, "num_experts"),
    (dict(swiglu_alpha="fast"), EP_SIZE, "swiglu_alpha"),
    (dict(activation=None), EP_SIZE, "activation"),
    (dict(inference="yes"), EP_SIZE, "inference"),
    (dict(inference=1), EP_SIZE, "inference"),
    (dict(top_k=True), EP_SIZE, "top_k"),
    (dict(num_activation_slots=False), EP_SIZE, "num_activation_slots"),
    (dict(swiglu_limit=True), EP_SIZE, "swiglu_limit"),
    (dict(activation_slot_bytes=1.5), EP_SIZE, "activation_slot_bytes"),
    (dict(), 4.0, "ep_size"),
    (dict(), True, "ep_size"),
]


def _entry_points():
    """Every public entry that takes a Config must apply the same rules (C++ validate underneath)."""

    def create(config, ep_size):
        poise.create_context(config=config, ep_size=ep_size, rank=0).close()

    return {
        "validate": lambda config, ep_size: config.validate(ep_size),
        "plan_memory": poise.plan_memory,
        "create_context": create,
    }


@pytest.mark.parametrize("entry", sorted(_entry_points()))
@pytest.mark.parametrize("changes, ep_size, name", RULES, ids=[f"{r[2]}-{i}" for i, r in enumerate(RULES)])
def test_every_rule_raises_invalid_argument_naming_the_field(entry, changes, ep_size, name):
    with pytest.raises(poise.InvalidArgument) as raised:  # building the Config, or using it
        _entry_points()[entry](make(**changes), ep_size)
    error = raised.value
    assert error.name == name
    assert str(error).startswith(f"{name}: ")
    assert error.rule and error.rule in str(error)


def test_invalid_argument_is_a_value_error_and_pickles():
    with pytest.raises(ValueError):
        make(top_k=0).validate(EP_SIZE)
    try:
        make(top_k=0).validate(EP_SIZE)
    except poise.InvalidArgument as error:
        copy = pickle.loads(pickle.dumps(error))
        assert (copy.name, str(copy)) == (error.name, str(error))


def test_validate_rejects_a_non_config():
    with pytest.raises(TypeError, match="poise.Config"):
        poise.plan_memory(dict(VALID), EP_SIZE)


def test_a_config_is_checked_when_built():
    with pytest.raises(poise.InvalidArgument) as raised:
        make(top_k=-3)
    assert raised.value.name == "top_k"
    with pytest.raises(poise.InvalidArgument) as raised:
        dataclasses.replace(make(), activation="nonsense")
    assert raised.value.name == "activation"
    make(num_experts=18, top_k=2)  # divisibility by the EP size is checked on use
    with pytest.raises(poise.InvalidArgument, match="num_experts"):
        make(num_experts=18, top_k=2).validate(EP_SIZE)


def test_error_types_are_the_documented_hierarchy():
    assert issubclass(poise.InvalidArgument, ValueError)
    assert issubclass(poise.NotAvailable, RuntimeError)
    assert issubclass(poise.DeviceError, RuntimeError)
