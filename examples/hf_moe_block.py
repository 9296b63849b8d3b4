"""A drop-in replacement for a Hugging Face-style sparse MoE block: the router stays in PyTorch,
Poise runs the experts.

    python examples/hf_moe_block.py --device cpu

`HFStyleSparseMoeBlock` is written the way transformers writes Mixtral's / Qwen2-MoE's block (a
gate Linear, softmax routing, top-k, renormalized weights, a ModuleList of gate/up/down experts, a
Python loop over experts). `PoiseSparseMoeBlock.from_hf(block, context)` takes its weights and has
the same forward signature and outputs, (hidden_states, router_logits). The script checks that both
agree (outputs and every gradient) against the HF block computed in float32.

Shapes: a Poise context has a fixed T (tokens per call). The block flattens [batch, seq, D] to rows
and pads them up to T with rows whose scores are zero (they contribute nothing and get zero
gradients), so any batch * seq <= T runs without recompiling or replanning. For expert parallelism,
create the context with ``group=...``: each rank then holds E/ep_size experts (``from_hf`` takes
rank's slice).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import poise


class Expert(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HFStyleSparseMoeBlock(torch.nn.Module):
    """The eager block as Hugging Face models write it (the reference)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(Expert(hidden, intermediate) for _ in range(num_experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        router_logits = self.gate(x.to(self.gate.weight.dtype))
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, pick = torch.where(selected == e)
            if token.numel():
                out = out.index_add(0, token, expert(x[token]) * weights[token, pick, None])
        return out.reshape(batch, seq, hidden), router_logits


class PoiseSparseMoeBlock(torch.nn.Module):
    """Same forward as HFStyleSparseMoeBlock; the experts run in one poise.routed_experts call."""

    def __init__(self, gate: torch.nn.Linear, w13: torch.Tensor, w2: torch.Tensor, context: poise.Context):
        super().__init__()
        config = context.config
        self.gate = gate
        self.w13 = torch.nn.Parameter(w13)  # [E_local, 2F, D]: gate rows, then up rows
        self.w2 = torch.nn.Parameter(w2)    # [E_local, D, F]
        self.context, self.top_k = context, config.top_k
        self.num_experts, self.max_tokens = config.num_experts, config.num_local_input_tokens

    @classmethod
    def from_hf(cls, block: HFStyleSparseMoeBlock, context: poise.Context) -> "PoiseSparseMoeBlock":
        local = block.num_experts // context.ep_size
        mine = block.experts[context.rank * local:(context.rank + 1) * local]
        w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in mine])
        w2 = torch.stack([e.down_proj.weight for e in mine])
        return cls(block.gate, w13.detach().to(torch.bfloat16).contiguous(), w2.detach().to(torch.bfloat16).contiguous(),
                   context)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        rows = x.shape[0]
        if rows > self.max_tokens:
            raise ValueError(f"batch * seq = {rows} exceeds the context's num_local_input_tokens={self.max_tokens}")
        router_logits = self.gate(x.to(self.gate.weight.dtype))
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)  # fp32 scores: Poise takes them as they are

        # Pad to the context's T: padding rows pick distinct experts (spread out) with zero scores.
        padding = self.max_tokens - rows
        pad_ids = (torch.arange(padding, device=x.device)[:, None] + torch.arange(self.top_k, device=x.device)) \
            % self.num_experts
        x_TD = F.pad(x.to(torch.bfloat16), (0, 0, 0, padding))
        ids_TK = torch.cat([selected, pad_ids]).to(torch.int32)
        scores_TK = F.pad(weights, (0, 0, 0, padding))
        out_TD = poise.routed_experts(x_TD, ids_TK, scores_TK, self.w13, self.w2, self.context)
        return out_TD[:rows].to(hidden_states.dtype).reshape(batch, seq, hidden), router_logits


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--seq", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    hidden, intermediate, num_experts, top_k = 128, 192, 8, 2

    # The model's block, in bf16 like the rest of a bf16 model except the router, kept in fp32 as many
    # MoE models do (so top-k picks do not flip on bf16 rounding). Its float32 copy is the reference.
    hf_block = HFStyleSparseMoeBlock(hidden, intermediate, num_experts, top_k).to(device, torch.bfloat16)
    hf_block.gate.float()
    reference = copy.deepcopy(hf_block).float()
    config = poise.Config(num_local_input_tokens=64, hidden_dim=hidden, intermediate_dim=intermediate, top_k=top_k,
                          num_experts=num_experts)
    with poise.create_context(config=config, device=device) as context:
        block = PoiseSparseMoeBlock.from_hf(hf_block, context)  # takes over the gate, packs the experts
        del hf_block

        hidden_states = torch.randn(args.batch, args.seq, hidden, device=device).to(torch.bfloat16)
        grad = torch.randn_like(hidden_states)
        x_poise = hidden_states.clone().requires_grad_()
        out, logits = block(x_poise)
        out.backward(grad)
        x_ref = hidden_states.float().requires_grad_()
        want, want_logits = reference(x_ref)
        want.backward(grad.float())

    checks = {
        "hidden_states": relative_error(out, want),
        "router_logits": relative_error(logits, want_logits),
        "grad hidden_states": relative_error(x_poise.grad, x_ref.grad),
        "grad gate": relative_error(block.gate.weight.grad, reference.gate.weight.grad),
        "grad gate_proj": relative_error(block.w13.grad[:, :intermediate],
                                         torch.stack([e.gate_proj.weight.grad for e in reference.experts])),
        "grad up_proj": relative_error(block.w13.grad[:, intermediate:],
                                       torch.stack([e.up_proj.weight.grad for e in reference.experts])),
        "grad down_proj": relative_error(block.w2.grad, torch.stack([e.down_proj.weight.grad for e in reference.experts])),
    }
    for name, error in checks.items():
        print(f"{name:20s} relative error vs the HF block in fp32: {error:.2e}")
    worst = max(checks.values())
    assert worst < 2e-2, f"Poise block disagrees with the HF block: {worst:.2e}"
    print(f"ok: batch={args.batch} seq={args.seq} ({args.batch * args.seq} of T={config.num_local_input_tokens} rows), "
          f"D={hidden}, F={intermediate}, E={num_experts}, K={top_k}")


if __name__ == "__main__":
    main()
