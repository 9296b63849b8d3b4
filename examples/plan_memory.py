"""Prints Poise's per-rank memory plan for two real MoE models. Needs no GPU.

    python examples/plan_memory.py
"""

import poise

MODELS = {
    # 256 routed experts over 8 ranks, 4096 tokens per rank.
    "DeepSeek-V3, EP8": (
        poise.Config(num_local_input_tokens=4096, hidden_dim=7168, intermediate_dim=2048, top_k=8, num_experts=256),
        8,
    ),
    # Fine-grained experts (small F, many experts): on one GPU, then spread over 8.
    "Qwen3-30B-A3B, EP1": (
        poise.Config(num_local_input_tokens=8192, hidden_dim=2048, intermediate_dim=768, top_k=8, num_experts=128),
        1,
    ),
    "Qwen3-30B-A3B, EP8": (
        poise.Config(num_local_input_tokens=8192, hidden_dim=2048, intermediate_dim=768, top_k=8, num_experts=128),
        8,
    ),
}


def main() -> None:
    for name, (config, ep_size) in MODELS.items():
        plan = poise.plan_memory(config, ep_size)
        print(f"== {name}")
        print(plan.explain())


if __name__ == "__main__":
    main()
