"""poise.create_context(group=..., device='cuda'): a context over an NCCL communicator Poise owns.

CPU tests (everywhere): `import poise` never loads libnccl; the NCCL module loads lazily, reports its
versions, names bad arguments, and its contexts are poise._poise.Context objects. GPU test (device):
one process under torchrun, NCCL communicator of one rank, forward and backward against the CPU
reference engine, through the raw entry points (outputs NaN-poisoned first) and through the torch
ops, capacity and exact balance. Run this file as a script only under torchrun (the worker).
"""

import importlib.util
import os
import subprocess
import sys
import time

import pytest

TOLERANCE = 1e-2


def _nccl_module_built() -> bool:
    return importlib.util.find_spec("poise._poise_nccl") is not None


def _run(code: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_import_poise_does_not_load_nccl():
    result = _run(
        "import sys, poise\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('nccl module:', 'poise._poise_nccl' in sys.modules, 'libnccl:', 'libnccl' in maps)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "nccl module: False libnccl: False" in result.stdout


def test_nccl_module_loads_lazily_with_matching_versions():
    pytest.importorskip("torch")
    from poise import NotAvailable, nccl_context

    if not _nccl_module_built():
        with pytest.raises(NotAvailable, match="without its NCCL module"):
            nccl_context.load_native()
        return
    native = nccl_context.load_native()
    assert native.nccl_version() >= 22800
    assert native.nccl_version() // 100 == native.build_nccl_version // 100
    first, second = native.unique_id(), native.unique_id()
    assert isinstance(first, bytes) and len(first) == 128 and first != second


@pytest.mark.skipif(not _nccl_module_built(), reason="poise._poise_nccl not built (no NCCL >= 2.28 at build time)")
def test_nccl_module_contexts_are_poise_contexts_and_arguments_are_named():
    import poise
    from poise import _poise, nccl_context
    from poise.config import to_cpp

    native = nccl_context.load_native()
    config = poise.Config(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=128, top_k=2, num_experts=4)
    planned = native._planned_context(to_cpp(config))  # made by the other module's copy of the library
    assert isinstance(planned, _poise.Context)
    assert (planned.ep_size, planned.rank, planned.plan.ep_size) == (1, 0, 1)
    planned.close()
    assert planned.closed
    with pytest.raises(poise.InvalidArgument) as error:
        native.create_context(to_cpp(config), b"short", 1, 0, 0)
    assert error.value.name == "unique_id"
    with pytest.raises(poise.InvalidArgument) as error:
        native.create_context(to_cpp(config), native.unique_id(), 2, 2, 0)
    assert error.value.name == "rank"


@pytest.mark.skipif(not _nccl_module_built(), reason="poise._poise_nccl not built (no NCCL >= 2.28 at build time)")
def test_group_context_without_a_gpu_raises_device_error_and_closes():
    pytest.importorskip("torch")
    result = _run(
        "import torch.distributed as dist, poise\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "config = poise.Config(num_local_input_tokens=32, hidden_dim=128, intermediate_dim=128, top_k=2,"
        " num_experts=4)\n"
        "try:\n"
        "    poise.create_context(config=config, group=dist.group.WORLD, device='cuda')\n"
        "except poise.DeviceError as e:\n"
        "    print('DeviceError:', e)\n"
        "dist.destroy_process_group()\n",
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr
    assert "DeviceError: create_context: no CUDA device" in result.stdout


# ---- GPU: one process under torchrun ---------------------------------------------------------------


def _run_workers(nproc: int) -> None:
    assert _nccl_module_built(), (
        "poise._poise_nccl was not built: build with NCCL >= 2.28 (nccl.h, nccl_device.h, libnccl.so), e.g. "
        "pip install . -C cmake.define.POISE_NCCL_INCLUDE=<nvidia/nccl>/include "
        "-C cmake.define.POISE_NCCL_LIBRARY=<nvidia/nccl>/lib/libnccl.so.2"
    )
    seed = time.time_ns() % (2**31)  # fresh inputs every run; printed on failure
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "POISE_TEST_SEED": str(seed)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, f"seed {seed}\n{result.stdout}\n{result.stderr}"
    for rank in range(nproc):
        for balance in ("capacity", "exact"):
            for routing in ("uniform", "one_expert"):
                assert f"rank {rank} of {nproc}: {balance} {routing} ok" in result.stdout, result.stdout


@pytest.mark.gpu
def test_one_rank_nccl_context_matches_the_cpu_reference():
    _run_workers(1)


@pytest.mark.gpu
def test_nccl_context_on_every_gpu_matches_the_cpu_reference():
    """One process per GPU of this machine (2 to 8), NVLink (LSA) between real ranks."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 or more GPUs (the multi-GPU device kinds)")
    _run_workers(torch.cuda.device_count())


def _relative_error(got, want) -> float:
    import torch

    got, want = got.double().cpu(), want.double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return (got - want).norm().item() if want.norm() == 0 else ((got - want).norm() / want.norm()).item()


def _worker() -> None:
    import torch
    import torch.distributed as dist

    import poise
    from poise import _poise, reference

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = int(os.environ["POISE_TEST_SEED"])
    device = torch.device("cuda", local_rank)
    stream = torch.cuda.current_stream(device).cuda_stream
    names = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
    for balance in ("capacity", "exact"):
        for routing in ("uniform", "one_expert"):
            config = poise.Config(num_local_input_tokens=100, hidden_dim=192, intermediate_dim=320, top_k=4,
                                  num_experts=8 * world, balance=balance, receive_capacity_factor=float(world),
                                  activation="swiglu_clamped", swiglu_limit=1.5)
            everyone = reference.random_inputs(config, world, seed=seed, routing=routing, padding_rows=3)
            gen = torch.Generator().manual_seed(seed + 1)
            grad_outs = [torch.randn(100, 192, generator=gen).bfloat16() for _ in range(world)]
            engine = reference.Engine(config, world)
            want_out = engine.forward(**everyone)[rank]
            want = engine.backward(grad_outs)[rank]
            mine = {name: everyone[name][rank].to(device) for name in names}
            grad_out = grad_outs[rank].to(device)

            context = poise.create_context(config=config, group=dist.group.WORLD, device=device)
            assert (context.ep_size, context.rank, context.device) == (world, rank, f"cuda:{local_rank}")
            assert context._cpp.launch_ranks == 1

            # Raw entry points, every output NaN-poisoned first.
            nan = float("nan")
            out = torch.full_like(mine["x_TD"], nan)
            grad_x = torch.full_like(mine["x_TD"], nan)
            grad_scores = torch.full_like(mine["scores_TK"], nan)
            grad_w13 = torch.full_like(mine["w13"], nan, dtype=torch.float32)
            grad_w2 = torch.full_like(mine["w2"], nan, dtype=torch.float32)
            args = (mine["x_TD"].data_ptr(), mine["ids_TK"].data_ptr(), mine["scores_TK"].data_ptr(), "fp32",
                    mine["w13"].data_ptr(), "gate_up_blocked", mine["w2"].data_ptr())
            _poise.routed_experts_forward(context._cpp, *args, out.data_ptr(), stream)
            _poise.routed_experts_backward(context._cpp, *args, grad_out.data_ptr(), grad_x.data_ptr(),
                                           grad_scores.data_ptr(), grad_w13.data_ptr(), grad_w2.data_ptr(), False,
                                           stream)
            context.check()
            errors = {"out": _relative_error(out, want_out), "grad_x": _relative_error(grad_x, want.grad_x_TD),
                      "grad_scores": _relative_error(grad_scores, want.grad_scores_TK),
                      "grad_w13": _relative_error(grad_w13, want.grad_w13),
                      "grad_w2": _relative_error(grad_w2, want.grad_w2)}
            assert all(e < TOLERANCE for e in errors.values()), (balance, routing, "raw", errors)

            # The torch ops (autograd) on the same context.
            leaves = {n: t.clone().requires_grad_(n != "ids_TK") for n, t in mine.items()}
            torch_out = poise.routed_experts(*[leaves[n] for n in names], context)
            torch_out.backward(grad_out)
            context.check()
            errors = {"out": _relative_error(torch_out, want_out),
                      "grad_x": _relative_error(leaves["x_TD"].grad, want.grad_x_TD),
                      "grad_scores": _relative_error(leaves["scores_TK"].grad, want.grad_scores_TK),
                      "grad_w13": _relative_error(leaves["w13"].grad, want.grad_w13),
                      "grad_w2": _relative_error(leaves["w2"].grad, want.grad_w2)}
            assert all(e < TOLERANCE for e in errors.values()), (balance, routing, "torch ops", errors)
            context.close()  # collective: pipeline and window first, then the communicator
            assert context.closed
            print(f"rank {rank} of {world}: {balance} {routing} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
