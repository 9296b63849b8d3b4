"""C++ exceptions arrive as the Python classes of poise.errors, with the C++ message intact."""

import pytest

import poise
from poise import _poise


def test_invalid_argument_keeps_name_and_rule():
    with pytest.raises(poise.InvalidArgument) as raised:
        _poise._raise_cpp_error("invalid_argument", "x_TD", "must be bf16, got fp32")
    assert raised.value.name == "x_TD"
    assert raised.value.rule == "must be bf16, got fp32"
    assert str(raised.value) == "x_TD: must be bf16, got fp32"  # the C++ what(), unchanged


def test_a_rule_with_its_own_colons_survives():
    with pytest.raises(poise.InvalidArgument) as raised:
        _poise._raise_cpp_error("invalid_argument", "w13", "shape: [E, 2F, D]: got [1, 2]")
    assert raised.value.name == "w13"
    assert str(raised.value) == "w13: shape: [E, 2F, D]: got [1, 2]"


@pytest.mark.parametrize(
    "kind, error_type", [("not_available", poise.NotAvailable), ("device_error", poise.DeviceError)]
)
def test_runtime_errors_map_to_their_classes(kind, error_type):
    with pytest.raises(error_type, match="^the message$"):
        _poise._raise_cpp_error(kind, "", "the message")


def test_other_exceptions_are_not_mistaken_for_poise_errors():
    with pytest.raises(Exception) as raised:
        _poise._raise_cpp_error("something_else", "", "boom")
    assert not isinstance(raised.value, (poise.InvalidArgument, poise.NotAvailable, poise.DeviceError))
    assert "boom" in str(raised.value)
