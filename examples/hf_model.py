"""A Hugging Face transformers model whose experts run on Poise: train a few steps, then generate.

    python examples/hf_model.py --device cpu      # a tiny random Qwen3-MoE, the CPU reference engine
    python examples/hf_model.py --device cuda     # the same on the GPU
    python examples/hf_model.py --routing-plot routing.png   # and plot each MoE layer's routing

With a checkpoint, the only changes are ``from_pretrained(name, dtype=torch.bfloat16,
experts_implementation="poise")`` and the import that registers "poise" (docs/transformers.md).
"""

from __future__ import annotations

import argparse

import torch
import transformers

import poise
import poise.integrations.transformers as poise_hf  # registers experts_implementation="poise"


def tiny_qwen3_moe(device: str):
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                         moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                         max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)
    model.set_experts_implementation("poise")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--routing-plot", default=None, help="write a PNG of the training steps' routing")
    args = parser.parse_args()
    poise_hf.configure(record_routing=bool(args.routing_plot))  # routing_history(): [pass][MoE layer]

    model = tiny_qwen3_moe(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1)).to(args.device)
    for step in range(args.steps):  # learn one batch by heart: the loss must fall
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    if args.routing_plot:
        print("routing plot:", poise.plot_routing(poise_hf.routing_history(), args.routing_plot, title="tiny Qwen3-MoE"))

    model.eval()
    with torch.no_grad():  # prefill 4 x 8 tokens, then decode steps of 4 tokens: inference contexts
        generated = model.generate(batch[:, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)
    print("generated:", generated[0, 8:].tolist())
    print(f"poise contexts: {len(poise_hf.contexts)} (one training, one inference)")


if __name__ == "__main__":
    main()
