"""Device faults through the torch ops (pytest -m gpu): a bad batch never yields a silent wrong result.

A fault (an expert id out of range or picked twice by one token) stops the call on the device and
fills its outputs with NaN; the next call raises poise.DeviceError naming it, every call fails until
reset(), and after reset() results match the CPU reference again. sync_check raises in the call.
Contexts of different shapes coexist on one device, in any order."""

import subprocess
import sys

import pytest
import torch

import poise
from poise import reference

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-2
CONFIG = poise.Config(num_local_input_tokens=128, hidden_dim=256, intermediate_dim=192, top_k=4, num_experts=8)
NAMES = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")


def device():
    return torch.device("cuda", torch.cuda.current_device())


def inputs_for(config, seed):
    per_rank = reference.random_inputs(config, 1, seed=seed)
    return {name: per_rank[name][0].to(device()) for name in NAMES}


def cpu_out(config, inputs):
    with poise.create_context(config=config, device="cpu") as context:
        return poise.routed_experts(*[inputs[n].cpu() for n in NAMES], context)


def relative_error(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    return ((got - want).norm() / want.norm()).item()


def with_bad_ids(inputs, kind):
    bad = dict(inputs)
    ids = inputs["ids_TK"].clone()
    if kind == "out_of_range":
        ids[3, 1] = CONFIG.num_experts + 5
    elif kind == "negative":
        ids[3, 1] = -2
    else:  # a token picks one expert twice
        ids[3, 1] = ids[3, 0]
    bad["ids_TK"] = ids
    return bad


MESSAGES = {"out_of_range": "ids_TK holds expert id 13 at token 3", "negative": "ids_TK holds expert id -2 at token 3",
            "duplicate": "more than once at token 3"}


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_a_fault_fills_the_call_with_nan_raises_at_the_next_call_and_reset_recovers(kind):
    good = inputs_for(CONFIG, seed=11)
    with torch.no_grad(), poise.create_context(config=CONFIG, device=device()) as context:
        out = poise.routed_experts(*[with_bad_ids(good, kind)[n] for n in NAMES], context)
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), "the faulted call's output must be NaN, not a plausible result"
        with pytest.raises(poise.DeviceError, match=MESSAGES[kind]):
            poise.routed_experts(*[good[n] for n in NAMES], context)
        with pytest.raises(poise.DeviceError, match=MESSAGES[kind]):  # sticky until reset()
            poise.routed_experts(*[good[n] for n in NAMES], context)
        context.reset()
        out = poise.routed_experts(*[good[n] for n in NAMES], context)
        context.check()
    assert relative_error(out, cpu_out(CONFIG, good)) < TOLERANCE


def test_sync_check_raises_in_the_faulted_call():
    good = inputs_for(CONFIG, seed=12)
    bad = with_bad_ids(good, "out_of_range")
    with torch.no_grad(), poise.create_context(config=CONFIG, device=device()) as context:
        with pytest.raises(poise.DeviceError, match=MESSAGES["out_of_range"]):
            poise.routed_experts(*[bad[n] for n in NAMES], context, poise.ExecutionOptions(sync_check=True))
        context.reset()
    with torch.no_grad(), poise.create_context(config=CONFIG, device=device(), sync_check=True) as context:
        with pytest.raises(poise.DeviceError, match=MESSAGES["out_of_range"]):
            poise.routed_experts(*[bad[n] for n in NAMES], context)


def test_contexts_of_different_shapes_coexist_in_any_order():
    shapes = {
        "A": poise.Config(num_local_input_tokens=192, hidden_dim=192, intermediate_dim=128, top_k=8, num_experts=32),
        "B": poise.Config(num_local_input_tokens=192, hidden_dim=256, intermediate_dim=64, top_k=2, num_experts=8,
                          balance="capacity"),
        "C": poise.Config(num_local_input_tokens=320, hidden_dim=320, intermediate_dim=192, top_k=4, num_experts=16),
    }
    inputs = {name: inputs_for(config, seed=20 + i) for i, (name, config) in enumerate(shapes.items())}
    contexts = {name: poise.create_context(config=config, device=device()) for name, config in shapes.items()}
    try:
        with torch.no_grad():
            for name in "ABACBA":
                out = poise.routed_experts(*[inputs[name][n] for n in NAMES], contexts[name])
                contexts[name].check()
                assert relative_error(out, cpu_out(shapes[name], inputs[name])) < TOLERANCE, name
    finally:
        for context in contexts.values():
            context.close()


def test_a_process_that_used_a_gpu_context_exits_without_leak_warnings():
    script = """
import torch, poise
from poise import reference
config = poise.Config(num_local_input_tokens=64, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4)
inputs = reference.random_inputs(config, 1, seed=1)
context = poise.create_context(config=config, device="cuda")
args = [inputs[n][0].cuda() for n in ("x_TD", "ids_TK", "scores_TK", "w13", "w2")]
args[0].requires_grad_()
out = poise.routed_experts(*args, context)
out.sum().backward()
context.check()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leak" not in done.stderr.lower(), done.stderr
