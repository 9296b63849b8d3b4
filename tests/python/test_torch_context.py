"""Contexts for the torch ops: devices, groups, activation slots, reset/close, the GPU entry points."""

import pytest
import torch

import poise
from poise import _poise, reference

CONFIG = poise.Config(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4,
                      num_activation_slots=2, max_moe_layers_per_activation_slot=3)


@pytest.mark.parametrize("device, name", [("cpu", "cpu"), (torch.device("cpu"), "cpu"), ("cuda", "cuda"),
                                          (torch.device("cuda", 1), "cuda:1"), ("cuda:0", "cuda:0")])
def test_device_names(device, name):
    with poise.create_context(config=CONFIG, device=device) as context:
        assert context.device == name
        assert (context.ep_size, context.rank, context.group) == (1, 0, None)
        assert f"on {name}" in repr(context)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:-1", "cpu:0", 3])
def test_bad_device_is_named(device):
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.create_context(config=CONFIG, device=device)
    assert raised.value.name == "device"


def test_cpu_with_several_ranks_needs_a_group():
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.create_context(config=CONFIG, device="cpu", ep_size=2, rank=0)
    assert raised.value.name == "group" and "virtual_ranks=True" in raised.value.rule


def test_group_needs_torch_distributed():
    assert not torch.distributed.is_initialized()
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.create_context(config=CONFIG, device="cpu", group=object())
    assert raised.value.name == "group"


def test_select_activation_slot():
    with poise.create_context(config=CONFIG, device="cpu") as context:
        assert context.activation_slot is None  # no selection yet: the working buffers
        context.select_activation_slot(1, 3)
        assert context.activation_slot == (1, 3)
        for args, name in [((2, 1), "slot"), ((-1, 1), "slot"), ((0, 0), "num_moe_layers_in_slot"),
                           ((0, 4), "num_moe_layers_in_slot"), ((0.0, 1), "slot"), ((0, "2"), "num_moe_layers_in_slot")]:
            with pytest.raises(poise.InvalidArgument) as raised:
                context.select_activation_slot(*args)
            assert raised.value.name == name, args
        assert context.activation_slot == (1, 3)  # a rejected selection changes nothing
    with pytest.raises(poise.InvalidArgument) as raised:
        context.select_activation_slot(0, 1)
    assert raised.value.name == "context"


def test_an_inference_context_has_no_slots():
    config = poise.Config(**{**CONFIG.__dict__, "inference": True})
    with poise.create_context(config=config, device="cpu") as context:
        assert context.activation_slot is None
        with pytest.raises(poise.InvalidArgument) as raised:
            context.select_activation_slot(0, 1)
        assert raised.value.name == "context"


def test_slot_selection_does_not_change_cpu_results():
    inputs = {k: v[0] for k, v in reference.random_inputs(CONFIG, 1, seed=4).items()}
    args = [inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
    with poise.create_context(config=CONFIG, device="cpu") as context:
        first = poise.routed_experts(*args, context)
        context.select_activation_slot(1, 2)
        assert torch.equal(first, poise.routed_experts(*args, context))


def test_reset_drops_the_saved_forward_and_close_stops_calls():
    inputs = {k: v[0] for k, v in reference.random_inputs(CONFIG, 1, seed=4).items()}
    inputs["x_TD"].requires_grad_()
    args = [inputs[n] for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
    context = poise.create_context(config=CONFIG, device="cpu")
    out = poise.routed_experts(*args, context)
    context.reset()  # as after an aborted call: what the forward kept is gone, backward recomputes it
    out.float().sum().backward()
    assert context._backend.recomputed_forwards == 1 and inputs["x_TD"].grad is not None
    context.close()
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.routed_experts(*args, context)
    assert raised.value.name == "context"


ADDRESS = 0x1000  # never dereferenced: these calls stop at host validation


def forward_entry(context, x_TD=ADDRESS, scores_dtype="bf16"):
    _poise.routed_experts_forward(context._cpp, x_TD, ADDRESS, ADDRESS, scores_dtype, ADDRESS, "gate_up_blocked",
                                  ADDRESS, ADDRESS, 0)


def test_gpu_entry_points_validate_on_the_host():
    """The C++ entry points the CUDA ops call: named errors before any device work."""
    with poise.create_context(config=CONFIG, device="cuda") as context:
        with pytest.raises(poise.InvalidArgument) as raised:
            forward_entry(context, x_TD=0)
        assert raised.value.name == "x_TD"
        with pytest.raises(poise.InvalidArgument) as raised:
            forward_entry(context, scores_dtype="fp16")
        assert raised.value.name == "scores_TK"
    # Several GPUs need a communicator-backed context, which this build does not have: said, not faked.
    with poise.create_context(config=CONFIG, device="cuda", ep_size=2, rank=0) as context:
        with pytest.raises(poise.NotAvailable, match="communicator"):
            forward_entry(context)
        with pytest.raises(poise.NotAvailable, match="communicator"):
            _poise.routed_experts_backward(context._cpp, *[ADDRESS] * 3, "fp32", ADDRESS, "gate_up_blocked",
                                           *[ADDRESS] * 6, True, 0)


def test_gpu_entry_points_without_a_device_raise_device_error():
    """No CUDA device (hidden here even on a GPU machine): DeviceError, never a result."""
    import os
    import subprocess
    import sys

    code = (
        "import poise\n"
        "config = poise.Config(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4)\n"
        "context = poise.create_context(config=config, device='cuda')\n"
        "a = 0x1000\n"
        "try:\n"
        "    poise._poise.routed_experts_forward(context._cpp, a, a, a, 'bf16', a, 'gate_up_blocked', a, a, 0)\n"
        "except poise.DeviceError as error:\n"
        "    print('DeviceError:', error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("DeviceError:") and "no CUDA device" in result.stdout


def test_check_on_a_cpu_context_has_nothing_to_wait_for():
    with poise.create_context(config=CONFIG, device="cpu") as context:
        context.check()
    with pytest.raises(poise.InvalidArgument) as raised:
        context.check()
    assert raised.value.name == "context"


def test_poise_routed_experts_is_lazy_and_torch_free_at_import():
    import subprocess
    import sys

    code = ("import sys, poise; assert 'torch' not in sys.modules; f = poise.routed_experts; "
            "assert 'torch' in sys.modules and f is poise.torch.api.routed_experts; "
            "assert hasattr(__import__('torch').ops.poise, 'routed_experts_forward'); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


def test_the_ops_load_no_oracles_or_input_generators():
    """A CUDA context needs nothing of poise.reference; a CPU context only its engine."""
    import subprocess
    import sys

    code = (
        "import sys, torch, poise\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('poise.reference'))\n"
        "poise.routed_experts, poise.routed_experts_virtual\n"
        "assert loaded() == [], loaded()\n"
        "config = poise.Config(num_local_input_tokens=8, hidden_dim=64, intermediate_dim=64, top_k=2, num_experts=4)\n"
        "x_TD, scores_TK = torch.randn(8, 64).bfloat16(), torch.ones(8, 2)\n"
        "ids_TK = torch.tensor([[0, 1]] * 8, dtype=torch.int32)\n"
        "w13, w2 = torch.randn(4, 128, 64).bfloat16(), torch.randn(4, 64, 64).bfloat16()\n"
        "with poise.create_context(config=config, device='cpu') as context:\n"
        "    poise.routed_experts(x_TD, ids_TK, scores_TK, w13, w2, context)\n"
        "assert loaded() == ['poise.reference', 'poise.reference.arrays', 'poise.reference.engines'], loaded()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr
