"""A BF16 training loop whose MoE layer runs its routed experts on Poise (router outside, in PyTorch).

    torchrun --nproc_per_node 1 examples/train_moe.py                  # one GPU
    torchrun --nproc_per_node 8 examples/train_moe.py                  # one GPU per rank (Poise's NCCL
                                                                       # context; run on 2 H200 so far)
    torchrun --nproc_per_node 2 examples/train_moe.py --device cpu     # CPU reference engine over gloo
    python examples/train_moe.py --device cpu                          # one process, no torchrun
    python examples/train_moe.py --device cpu --gemm-precision fp8_block_scaled --losses fp8.json

A student MoE layer learns to imitate a fixed random teacher layer. What it shows:
- one Context per MoE layer, created collectively over the EP group (torch.distributed WORLD here);
  (layers may share one context instead: ``context.select_activation_slot(slot, num_layers)`` before
  their forwards keeps what each backward needs, docs/pytorch.md "Activation slots");
- the router in PyTorch (fp32 logits, top-k, renormalized scores) and int32 ids for Poise;
- BF16 expert weights with fp32 ``main_grad`` buffers and ``accumulate_wgrad=True``: the micro-batches'
  weight grads are added in place (Megatron's gradient_accumulation_fusion contract), and an fp32
  master copy of every weight is what the optimizer updates;
- expert parallelism: each rank owns E/ep_size experts, so expert grads need no all-reduce, while the
  replicated router's grads are averaged over the ranks;
- routing telemetry: ``context.routing_stats()`` after a forward (device tensors, no sync) and, with
  ``--routing-plot PATH``, ``poise.plot_routing`` of every step's expert loads and peak/mean.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import poise


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="T: tokens per rank and micro-batch")
    parser.add_argument("--hidden", type=int, default=128, help="D: a multiple of 64")
    parser.add_argument("--intermediate", type=int, default=128, help="F: a multiple of 64")
    parser.add_argument("--experts", type=int, default=8, help="E: divisible by the number of ranks")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--routing-plot", default=None, help="write a PNG of the routing over the steps (rank 0)")
    parser.add_argument("--gemm-precision", choices=["bf16", "fp8_block_scaled"], default="bf16",
                        help="the student's expert GEMMs (docs/fp8.md); the teacher stays bf16")
    parser.add_argument("--fp8-wgrad", action="store_true",
                        help="with fp8_block_scaled: the weight gradients' GEMMs in FP8 too (Config.fp8_wgrad)")
    parser.add_argument("--losses", default=None, help="write every step's loss as a JSON list (rank 0)")
    return parser.parse_args()


class MoELayer(torch.nn.Module):
    """Router (replicated, fp32) + this rank's routed experts (bf16, on Poise)."""

    def __init__(self, config: poise.Config, context: poise.Context, device: torch.device, seed: int):
        super().__init__()
        D, F, E = config.hidden_dim, config.intermediate_dim, config.num_experts
        local = E // context.ep_size
        shared = torch.Generator(device="cpu").manual_seed(seed)  # the same router on every rank
        own = torch.Generator(device="cpu").manual_seed(seed * 1000 + context.rank + 1)  # this rank's experts
        self.router = torch.nn.Parameter((torch.randn(E, D, generator=shared) * D**-0.5).to(device))
        self.w13 = torch.nn.Parameter((torch.randn(local, 2 * F, D, generator=own) * D**-0.5).to(device, torch.bfloat16))
        self.w2 = torch.nn.Parameter((torch.randn(local, D, F, generator=own) * F**-0.5).to(device, torch.bfloat16))
        self.config, self.context = config, context

    def forward(self, x_TD: torch.Tensor, options: poise.ExecutionOptions | None = None) -> torch.Tensor:
        probs = torch.softmax(x_TD.float() @ self.router.T, dim=-1)
        scores_TK, ids_TK = torch.topk(probs, self.config.top_k, dim=-1)
        scores_TK = scores_TK / scores_TK.sum(dim=-1, keepdim=True)
        return poise.routed_experts(x_TD, ids_TK.to(torch.int32), scores_TK, self.w13, self.w2, self.context, options)


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ  # launched by torchrun
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    group = dist.group.WORLD if distributed else None
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    config = poise.Config(num_local_input_tokens=args.tokens, hidden_dim=args.hidden, intermediate_dim=args.intermediate,
                          top_k=args.topk, num_experts=args.experts, gemm_precision=args.gemm_precision,
                          fp8_wgrad=args.fp8_wgrad)
    teacher_config = poise.Config(**{**config.__dict__, "inference": True, "gemm_precision": "bf16", "fp8_wgrad": False})
    if rank == 0:
        print(poise.plan_memory(config, world).explain(), flush=True)

    with poise.create_context(config=config, group=group, device=device) as context, \
         poise.create_context(config=teacher_config, group=group, device=device) as teacher_context:
        student = MoELayer(config, context, device, seed=1)
        teacher = MoELayer(teacher_config, teacher_context, device, seed=2)
        for weight in (student.w13, student.w2):
            weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)  # wgrad_dtype fp32
        masters = [student.w13.detach().float().requires_grad_(), student.w2.detach().float().requires_grad_()]
        optimizer = torch.optim.AdamW([student.router, *masters], lr=args.lr, weight_decay=0.0)
        accumulate = poise.ExecutionOptions(accumulate_wgrad=True)
        data = torch.Generator(device="cpu").manual_seed(100 + rank)

        history = []  # [step][layer] RoutingStats, for --routing-plot
        losses = []
        for step in range(args.steps):
            total = torch.zeros((), device=device)
            for micro_batch in range(args.micro_batches):
                x_TD = torch.randn(args.tokens, args.hidden, generator=data).to(device, torch.bfloat16)
                with torch.no_grad():
                    target_TD = teacher(x_TD)
                out_TD = student(x_TD, accumulate)
                if micro_batch == 0:
                    history.append([context.routing_stats()])  # no sync: read when plotting
                loss = torch.nn.functional.mse_loss(out_TD.float(), target_TD.float())
                (loss / args.micro_batches).backward()
                total += loss.detach() / args.micro_batches

            # The global loss is the mean over ranks: average the router's grads; an expert's grads
            # already hold every rank's tokens (they were computed on its owner), so divide by world.
            if distributed:
                dist.all_reduce(student.router.grad)
                dist.all_reduce(total)
            student.router.grad /= world
            for master, weight in zip(masters, (student.w13, student.w2)):
                master.grad = weight.main_grad / world
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for master, weight in zip(masters, (student.w13, student.w2)):
                    weight.copy_(master)  # fp32 master -> bf16 weight
                    weight.main_grad.zero_()
            losses.append(total.item() / world)
            if rank == 0:
                print(f"step {step}: loss {losses[-1]:.5f}", flush=True)
        if rank == 0 and args.losses:
            with open(args.losses, "w") as f:
                json.dump(losses, f)
        if rank == 0 and args.routing_plot:
            last = history[-1][0]
            print(f"routing: peak/mean rows per rank {last.owner_peak_over_mean.item():.2f} before balancing, "
                  f"{last.computed_peak_over_mean.item():.2f} after; plot {poise.plot_routing(history, args.routing_plot)}",
                  flush=True)

    if distributed:
        dist.barrier()  # every rank done with the group before any tears it down (gloo aborted otherwise)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
