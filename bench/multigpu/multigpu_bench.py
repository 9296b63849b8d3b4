"""Expert parallelism on real GPUs, one process per GPU (issue 7): correctness, then timings.

    torchrun --standalone --nproc_per_node=N bench/multigpu/multigpu_bench.py OUT.json [--quick]
             [--peak-means=1,1.5,N]

Every process owns one GPU and one NCCL Poise context (poise.create_context(group=...)); NVLink
multicast stays off (the caller exports NCCL_NVLS_ENABLE=0). Rank 0 writes OUT.json.

1. correctness: small layers (capacity and exact balance, uniform and hot-expert routing, plain and
   clamped SwiGLU): every rank's out_TD and gradients against the CPU reference engine of all N
   ranks (inputs drawn identically on every process from one seed).
2. rows over NCCL: all_to_all_single of T*K rows of D bf16 (equal splits), the transport baseline.
3. the layer at the DeepSeek-V3 per-rank shape (T=4096, D=7168, F=2048, E=256, K=8; E_local =
   256/N): Poise forward and forward+backward at rows-per-rank peak/mean 1, 1.5 and N (every pick
   on rank 0's experts), exact balance (tolerance 0 and 0.5) and balancing off (capacity), next to the torch baseline on the same
   inputs: all_to_all_single dispatch + torch._grouped_mm + SwiGLU + torch._grouped_mm +
   all_to_all_single combine (autograd through torch.distributed.nn.functional.all_to_all_single).
   Poise with F=64 stands in for its data path alone (route, dispatch, combine; experts ~free).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as Fn

import poise
from poise import reference

TOLERANCE = 2e-2
WGRAD_DTYPE = os.environ.get("POISE_BENCH_WGRAD", "bf16")


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def relative_error(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


# ---- 1. correctness --------------------------------------------------------------------------------

def check_correctness(device, world, rank) -> list[dict]:
    names = ("x_TD", "ids_TK", "scores_TK", "w13", "w2")
    results = []
    for balance in ("capacity", "exact"):
        for routing in ("uniform", "one_expert"):
            for activation in ("swiglu", "swiglu_clamped"):
                config = poise.Config(num_local_input_tokens=64, hidden_dim=256, intermediate_dim=192, top_k=4,
                                      num_experts=8 * world, balance=balance, activation=activation,
                                      swiglu_limit=0.75, receive_capacity_factor=float(world))
                everyone = reference.random_inputs(config, world, seed=11, routing=routing)
                grad_outs = [torch.randn(64, 256, generator=torch.Generator().manual_seed(100 + r)).bfloat16()
                             for r in range(world)]
                mine = {n: everyone[n][rank].to(device).requires_grad_(n != "ids_TK") for n in names}
                clips = poise.ExecutionOptions(clip_statistics=True)
                with poise.create_context(config=config, group=dist.group.WORLD, device=device) as context:
                    out, counts = poise.routed_experts(*[mine[n] for n in names], context, clips)
                    out.backward(grad_outs[rank].to(device))
                    context.check()
                engine = reference.Engine(config, world)
                want_out = engine.forward(*[everyone[n] for n in names])[rank]
                want_counts = engine.clip_counts[rank]
                want = engine.backward(grad_outs)[rank]
                errors = {"out_TD": relative_error(out, want_out),
                          "grad_x_TD": relative_error(mine["x_TD"].grad, want.grad_x_TD),
                          "grad_scores_TK": relative_error(mine["scores_TK"].grad, want.grad_scores_TK),
                          "grad_w13": relative_error(mine["w13"].grad, want.grad_w13.reshape(mine["w13"].shape)),
                          "grad_w2": relative_error(mine["w2"].grad, want.grad_w2.reshape(mine["w2"].shape))}
                counts_ok = bool(((counts.cpu() - want_counts).abs() <= want_counts // 100 + 2).all())
                ok = all(e < TOLERANCE for e in errors.values()) and counts_ok
                flags = torch.tensor([int(ok)], device=device)
                dist.all_reduce(flags, op=dist.ReduceOp.MIN)
                case = f"{balance}/{routing}/{activation}"
                results.append({"case": case, "rank0_errors": errors, "clip_counts_ok": counts_ok,
                                "all_ranks_pass": bool(flags.item())})
                log(f"correctness {case}: {'PASS' if flags.item() else 'FAIL'} "
                    + " ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f" clip_counts {counts_ok}")
    return results


# ---- timing helpers --------------------------------------------------------------------------------

def time_ms(fn, iterations: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    # The slowest rank decides the layer's time.
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ---- 2. all_to_all_single bandwidth ---------------------------------------------------------------

def a2a_bandwidth(device, world, T, D, K, iterations) -> dict:
    rows = torch.randn(T * K, D, device=device).bfloat16()
    out = torch.empty_like(rows)
    ms = time_ms(lambda: dist.all_to_all_single(out, rows), iterations)
    bytes_total = rows.numel() * 2
    to_others = bytes_total * (world - 1) / world
    return {"rows": T * K, "D": D, "ms": ms, "bytes_per_rank": bytes_total, "bytes_to_other_ranks": to_others,
            "GBps_rows_per_rank": bytes_total / ms / 1e6, "GBps_to_others_per_rank": to_others / ms / 1e6}


# ---- 3. the layer ------------------------------------------------------------------------------------

def make_routing(T, K, E, world, peak_mean, generator, device):
    """ids [T, K], distinct per token; each token puts about K * peak_mean / world picks on rank 0's
    experts (every pick when peak_mean == world), the rest on other ranks' experts."""
    E_local = E // world
    hot_share = min(1.0, peak_mean / world)
    expected = K * hot_share
    m = torch.full((T,), int(expected), device=device)
    m += (torch.rand(T, generator=generator, device=device) < expected - int(expected)).long()
    hot = torch.rand(T, E_local, generator=generator, device=device).argsort(dim=1)[:, :K]
    cold = torch.rand(T, E - E_local, generator=generator, device=device).argsort(dim=1)[:, :K] + E_local
    if E - E_local < K:
        cold = hot  # world == 1: everything is "hot"
    pick = torch.arange(K, device=device).unsqueeze(0) < m.unsqueeze(1)
    return torch.where(pick, hot, cold).to(torch.int32)


def baseline_layer(x, ids, scores, w13, w2, world, group):
    """all_to_all_single dispatch of every (t, k) row, grouped GEMMs per local expert, all_to_all back."""
    T, K = ids.shape
    E_local = w13.shape[0]
    flat = ids.flatten().long()
    dest = flat // E_local
    order = torch.argsort(flat, stable=True)  # by expert, so by destination rank too
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_splits, recv_splits = send.tolist(), recv.tolist()  # host sync: the baseline's splits
    tok = order // K
    x_send = x.index_select(0, tok)
    x_recv = dist_fn.all_to_all_single(x.new_empty(sum(recv_splits), x.shape[1]), x_send, recv_splits, send_splits,
                                       group=group)
    e_recv = torch.empty(sum(recv_splits), dtype=torch.long, device=x.device)
    dist.all_to_all_single(e_recv, flat.index_select(0, order) % E_local, recv_splits, send_splits, group=group)
    local_order = torch.argsort(e_recv, stable=True)
    offs = torch.cumsum(torch.bincount(e_recv, minlength=E_local), 0, dtype=torch.int32)
    xs = x_recv.index_select(0, local_order)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(Fn.silu(g) * u, w2.transpose(1, 2), offs=offs)
    y_back = torch.empty_like(y).index_copy(0, local_order, y)
    y_ret = dist_fn.all_to_all_single(y.new_empty(sum(send_splits), y.shape[1]), y_back, send_splits, recv_splits,
                                      group=group)
    y_ret = y_ret * scores.flatten().index_select(0, order).unsqueeze(1).to(y_ret.dtype)
    return torch.zeros_like(x).index_add(0, tok, y_ret)


def layer_timings(device, world, rank, shape, peak_means, iterations) -> list[dict]:
    T, D, F, E, K = shape
    E_local = E // world
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    w13 = (torch.randn(E_local, 2 * F, D, device=device, generator=gen) / D ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E_local, D, F, device=device, generator=gen) / F ** 0.5).bfloat16().requires_grad_()
    x = torch.randn(T, D, device=device, generator=gen).bfloat16().requires_grad_()
    grad_out = torch.randn(T, D, device=device, generator=gen).bfloat16()
    records = []
    for peak_mean in peak_means:
        ids = make_routing(T, K, E, world, peak_mean, gen, device)
        scores = torch.softmax(torch.randn(T, K, device=device, generator=gen), dim=1).requires_grad_()
        rows = torch.bincount(ids.flatten().long() // E_local, minlength=world)
        dist.all_reduce(rows)
        measured = (rows.max() / rows.float().mean()).item()
        record = {"peak_mean_target": peak_mean, "peak_mean": measured}

        def fwdbwd(forward):
            def run():
                out = forward()
                out.backward(grad_out)
                for t in (x, scores, w13, w2):
                    t.grad = None
            return run

        record["baseline_fwd_ms"] = time_ms(lambda: baseline_layer(x, ids, scores, w13, w2, world, None), iterations)
        record["baseline_fwdbwd_ms"] = time_ms(fwdbwd(lambda: baseline_layer(x, ids, scores, w13, w2, world, None)),
                                               iterations)
        for name, balance, tolerance in (("exact", "exact", 0.0), ("exact_tol0.5", "exact", 0.5),
                                         ("capacity", "capacity", 0.0)):
            # bf16 weight gradients, as the baseline's (fp32 ones cost 22 GB of writes at E_local=128,
            # plus autograd's cast to the bf16 parameters' dtype)
            config = poise.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K, num_experts=E,
                                  balance=balance, receive_capacity_factor=max(1.0, measured) * 1.02,
                                  balance_tolerance=tolerance, wgrad_dtype=WGRAD_DTYPE)
            with poise.create_context(config=config, group=dist.group.WORLD, device=device) as context:
                call = lambda: poise.routed_experts(x, ids, scores, w13, w2, context)  # noqa: E731
                with torch.no_grad():
                    record[f"poise_{name}_fwd_ms"] = time_ms(call, iterations)
                record[f"poise_{name}_fwdbwd_ms"] = time_ms(fwdbwd(call), iterations)
                context.check()
                # Where one forward+backward goes, stage by stage (this rank; one extra call).
                context.enable_stage_timing()
                fwdbwd(call)()
                record[f"poise_{name}_stages_ms_rank{rank}"] = context.stage_times()
                context.enable_stage_timing(False)
            torch.cuda.empty_cache()
        flops = 6.0 * T * K * D * F  # per rank, forward
        record["poise_exact_fwd_tflops_per_gpu"] = flops / record["poise_exact_fwd_ms"] / 1e9
        record["speedup_fwd_vs_baseline"] = record["baseline_fwd_ms"] / record["poise_exact_fwd_ms"]
        record["speedup_fwdbwd_vs_baseline"] = record["baseline_fwdbwd_ms"] / record["poise_exact_fwdbwd_ms"]
        records.append(record)
        log("layer", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items()}))
    return records


def data_path_proxy(device, world, shape, iterations) -> dict:
    """Poise forward and forward+backward with F=64: route, dispatch, combine, and nearly free experts."""
    T, D, _, E, K = shape
    F = 64
    E_local = E // world
    gen = torch.Generator(device=device).manual_seed(99)
    w13 = (torch.randn(E_local, 2 * F, D, device=device, generator=gen) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E_local, D, F, device=device, generator=gen) / F ** 0.5).bfloat16()
    x = torch.randn(T, D, device=device, generator=gen).bfloat16()
    ids = make_routing(T, K, E, world, 1.0, gen, device)
    scores = torch.softmax(torch.randn(T, K, device=device, generator=gen), dim=1)
    config = poise.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K, num_experts=E,
                          balance="capacity", receive_capacity_factor=1.25, inference=True)
    with poise.create_context(config=config, group=dist.group.WORLD, device=device) as context:
        with torch.no_grad():
            ms = time_ms(lambda: poise.routed_experts(x, ids, scores, w13, w2, context), iterations)
            context.enable_stage_timing()
            poise.routed_experts(x, ids, scores, w13, w2, context)
            stages = context.stage_times()["forward"]
    # Rows that cross: a token row goes once to each other rank holding one of its experts (dispatch);
    # combine returns one row per (t, k) whose expert is on another rank.
    dest = ids.long() // E_local
    me = dist.get_rank()
    crossing = sum(int(((dest == d).any(dim=1)).sum()) for d in range(world) if d != me)
    returned = int((dest != me).sum())
    row = D * 2
    return {"F": F, "fwd_ms": ms, "stages_ms": stages, "dispatch_bytes_to_others_rank0": crossing * row,
            "combine_bytes_to_others_rank0": returned * row,
            "GBps_to_others_rank0": (crossing + returned) * row / ms / 1e6}


def main() -> int:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "multigpu_h200.json"
    quick = "--quick" in sys.argv
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    log(f"{world} x {torch.cuda.get_device_name(device)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    report = {"world": world, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "commit": os.environ.get("POISE_COMMIT", "unknown"), "quick": quick, "wgrad_dtype": WGRAD_DTYPE}
    started = time.time()
    report["correctness"] = check_correctness(device, world, rank)
    shape = (512, 1024, 512, 8 * world, 4) if quick else (4096, 7168, 2048, 256, 8)
    report["shape"] = dict(zip(("T", "D", "F", "E", "K"), shape))
    iterations = 3 if quick else 5
    report["all_to_all_single"] = a2a_bandwidth(device, world, shape[0], shape[1], shape[4], iterations)
    log("all_to_all_single", json.dumps(report["all_to_all_single"]))
    report["poise_data_path_F64"] = data_path_proxy(device, world, shape, iterations)
    log("poise data path (F=64)", json.dumps(report["poise_data_path_F64"]))
    peak_means = [1.0, 1.5, float(world)]
    for arg in sys.argv:
        if arg.startswith("--peak-means="):
            peak_means = [float(v) for v in arg.split("=", 1)[1].split(",")]
    report["layer"] = layer_timings(device, world, rank, shape, peak_means, iterations)
    report["seconds"] = time.time() - started
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {out_path} ({report['seconds']:.0f} s)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(c["all_ranks_pass"] for c in report["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
