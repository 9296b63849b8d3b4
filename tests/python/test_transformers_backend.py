"""poise.integrations.transformers: "poise" as a transformers experts implementation.

Tiny random-initialized models built from transformers configs (no download), bf16, on the CPU
engine here (and on the GPU under the gpu marker): logits and a training step's gradients with
"poise" against "eager" (transformers' own per-expert loop), within bf16 tolerance, or, where a
bf16 rounding flips a router's choice in a later layer (the tiny DeepSeek-V3's router weight grad:
0.14-0.19 from fp32 for both fast paths, 0.01 for eager), no farther from "eager" than
"grouped_mm" (transformers' own fast path) is.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import poise  # noqa: E402
import poise.integrations.transformers as poise_hf  # noqa: E402

TOLERANCE = 3e-2  # relative L2; grouped_mm vs eager without routing flips: logits 4e-3, worst grad 8e-3
TINY = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)


def tiny_config(name: str):
    """A transformers config of each family at dims Poise takes (D=128, F=64)."""
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**TINY, intermediate_size=256, moe_intermediate_size=64, head_dim=32,
                                           num_experts=8, num_experts_per_tok=2)
    if name == "mixtral":
        return transformers.MixtralConfig(**TINY, intermediate_size=64, head_dim=32, num_local_experts=8,
                                          num_experts_per_tok=2)
    if name == "olmoe":
        return transformers.OlmoeConfig(**TINY, intermediate_size=64, num_experts=8, num_experts_per_tok=2)
    if name == "deepseek_v3":  # shared experts, grouped routing, a dense first layer, MLA
        return transformers.DeepseekV3Config(**{**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                             intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16,
                                             num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                             first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64,
                                             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    if name == "gpt_oss":
        return transformers.GptOssConfig(**TINY, intermediate_size=64, head_dim=32, num_local_experts=8,
                                         num_experts_per_tok=2)
    raise KeyError(name)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def tiny_model(name: str, device: str = "cpu"):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.bfloat16).to(device)


def training_step(model, implementation: str, token_ids):
    """Logits and every parameter's gradient of one forward+backward with ``implementation``."""
    model.set_experts_implementation(implementation)
    model.zero_grad()
    out = model(token_ids, labels=token_ids)
    out.loss.backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.float().detach(), grads


def relative_error(actual, expected) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


DEFAULT_SETTINGS = dataclasses.asdict(poise_hf.Settings())


@pytest.fixture(autouse=True)
def fresh_contexts():
    poise_hf.configure(**DEFAULT_SETTINGS)  # default settings, no cached context, no routing history
    yield
    poise_hf.configure(**DEFAULT_SETTINGS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_training_step_matches_eager(name, device):
    model = tiny_model(name, device)
    token_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    grads_poise = assert_training_step_like_eager(model, token_ids)
    assert len(poise_hf.contexts) == 1  # every MoE layer ran on one shared training context
    experts = [n for n in grads_poise if "experts.gate_up_proj" in n or "experts.down_proj" in n]
    assert experts and all(grads_poise[n].abs().sum() > 0 for n in experts)


def assert_training_step_like_eager(model, token_ids) -> dict:
    """Logits and every gradient of a training step with "poise" as close to "eager" as transformers'
    own "grouped_mm" is (or within TOLERANCE); returns poise's gradients."""
    logits_eager, grads_eager = training_step(model, "eager", token_ids)
    logits_grouped, grads_grouped = training_step(model, "grouped_mm", token_ids)
    logits_poise, grads_poise = training_step(model, "poise", token_ids)

    def bound(actual_grouped, expected):
        return max(TOLERANCE, 1.5 * relative_error(actual_grouped, expected))

    assert relative_error(logits_poise, logits_eager) < bound(logits_grouped, logits_eager)
    assert grads_poise.keys() == grads_eager.keys()
    for name in grads_eager:
        error = relative_error(grads_poise[name], grads_eager[name])
        assert error < bound(grads_grouped[name], grads_eager[name]), (name, error)
    return grads_poise


def test_implementation_is_valid_in_from_pretrained_and_on_a_built_model(tmp_path):
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                               experts_implementation="poise")
    assert loaded.config._experts_implementation == "poise"
    model.set_experts_implementation("poise")
    assert model.config._experts_implementation == "poise"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_generation_runs_every_step_on_poise_and_matches_eager_logits(name, device):
    """Prefill (2 x 12 tokens) then decode steps of 2 tokens: calls of changing size, each on the
    inference context of its bucket; the generated sequence then scores the same as under eager."""
    model = tiny_model(name, device).eval()
    prompt = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2)).to(device)
    model.set_experts_implementation("poise")
    with torch.no_grad():
        sequence = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert sequence.shape == (2, 18)
        assert len(poise_hf.contexts) == 1  # 24 and 2 tokens both fit the smallest bucket
        logits_poise = model(sequence).logits.float()
        model.set_experts_implementation("eager")
        logits_eager = model(sequence).logits.float()
    assert relative_error(logits_poise, logits_eager) < TOLERANCE


def eager_and_poise(experts, num_tokens: int, generator):
    """One inference call of ``num_tokens`` random tokens (top-2 of 8 experts) through "eager" and
    "poise": (eager's output in fp32, poise's)."""
    x = torch.randn(num_tokens, 128, generator=generator).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(num_tokens)])
    scores = torch.rand(num_tokens, 2, generator=generator)
    with torch.no_grad():
        experts.config._experts_implementation = "eager"
        expected = experts(x, ids, scores).float()
        experts.config._experts_implementation = "poise"
        return expected, experts(x, ids, scores)


def test_calls_of_any_size_up_to_max_tokens_pad_to_their_bucket():
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    poise_hf.configure(min_bucket_tokens=16, max_tokens=100)
    generator = torch.Generator().manual_seed(3)
    for num_tokens in (1, 16, 17, 100):
        expected, actual = eager_and_poise(experts, num_tokens, generator)
        assert actual.shape == (num_tokens, 128)
        assert relative_error(actual.float(), expected) < TOLERANCE
    empty = experts(torch.zeros(0, 128, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, 128)
    with pytest.raises(poise.InvalidArgument, match="max_tokens=100") as raised:
        experts(torch.zeros(101, 128, dtype=torch.bfloat16), torch.zeros(101, 2, dtype=torch.long),
                torch.zeros(101, 2))
    assert raised.value.name == "hidden_states"


def test_bucket_sizes_bound_the_padding():
    settings = poise_hf.Settings(max_tokens=10000, min_bucket_tokens=64, buckets_per_octave=4)
    assert [poise_hf.bucket_tokens(n, settings) for n in (1, 64, 65, 80, 81, 1000, 1024, 1025, 9000, 10000)] == [
        64, 64, 80, 80, 96, 1024, 1024, 1280, 10000, 10000]
    for n in range(65, 10001, 37):
        bucket = poise_hf.bucket_tokens(n, settings)
        assert n <= bucket <= min(10000, n * 1.25 + 1)


def test_padding_rows_get_no_gradient_and_add_nothing():
    """A call of 5 tokens on a 64-token context: the padding rows name no expert (id -1, never
    computed), and the real rows' output and grads equal eager's."""
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(5, 128, generator=generator).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(5)])
    scores = torch.rand(5, 2, generator=generator)
    x_TD, ids_TK, scores_TK = poise_hf._padded(x, ids, scores, 64)
    assert x_TD.shape == (64, 128) and bool((ids_TK[5:] == -1).all()) and bool((ids_TK[:5] == ids).all())
    results = {}
    for implementation in ("eager", "poise"):
        experts.config._experts_implementation = implementation
        experts.zero_grad()
        x_leaf, scores_leaf = x.clone().requires_grad_(), scores.clone().requires_grad_()
        experts(x_leaf, ids, scores_leaf).float().square().sum().backward()
        results[implementation] = (x_leaf.grad.float(), scores_leaf.grad.float(), experts.gate_up_proj.grad.float())
    for actual, expected in zip(results["poise"], results["eager"]):
        assert relative_error(actual, expected) < TOLERANCE


def test_inference_calls_reuse_their_padded_inputs_and_route_only_their_rows():
    """Inference calls of 12, 3 and 9 tokens on one 16-token context: each copies its rows into the
    padded inputs the context keeps (no new ones), the rows a larger call left behind name no expert
    again (routing counts the call's own rows only), and the outputs equal eager's."""
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    poise_hf.configure(min_bucket_tokens=16, max_tokens=100, record_routing=True)
    generator = torch.Generator().manual_seed(8)
    addresses = set()
    for num_tokens in (12, 3, 9):
        expected, actual = eager_and_poise(experts, num_tokens, generator)
        assert relative_error(actual.float(), expected) < TOLERANCE
        assert poise_hf.routing_history()[-1][0].expert_rows.sum().item() == num_tokens * 2
        (inputs,) = poise_hf.contexts._inference_inputs.values()
        assert bool((inputs.ids_TK[num_tokens:] == -1).all())
        addresses.add(inputs.x_TD.data_ptr())
    assert len(addresses) == 1


def test_inference_mode_then_no_grad_calls_share_the_padded_inputs():
    """A first call under torch.inference_mode() makes the kept padded inputs; a later call under
    plain no_grad writes them again (an inference tensor could not be), both equal to eager."""
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        expected, actual = eager_and_poise(experts, 5, generator)
    assert relative_error(actual.float(), expected) < TOLERANCE
    expected, actual = eager_and_poise(experts, 3, generator)  # eager_and_poise runs under no_grad
    assert relative_error(actual.float(), expected) < TOLERANCE
    (inputs,) = poise_hf.contexts._inference_inputs.values()
    assert not inputs.x_TD.is_inference()


def decode_calls(experts, routings, device):
    """Each (x, ids, scores) of ``routings`` through the module under no_grad: the outputs."""
    with torch.no_grad():
        return [experts(x.to(device), ids.to(device), scores.to(device)).float() for x, ids, scores in routings]


def random_routings(count: int, num_tokens: int, generator):
    return [(torch.randn(num_tokens, 128, generator=generator).to(torch.bfloat16),
             torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(num_tokens)]),
             torch.rand(num_tokens, 2, generator=generator)) for _ in range(count)]


@pytest.mark.gpu
def test_decode_calls_replay_a_cuda_graph_of_the_call():
    """GPU inference calls of a small bucket replay a CUDA graph captured after the module's first
    call: over fresh routings (and 8 then 3 tokens) the outputs equal those of calls made without
    graphs (graph_max_tokens=0), bit for bit; weights updated in place are read, weights in new
    storage are captured again; a device fault of a replayed call (an expert id out of range) raises
    at the next call."""
    model = tiny_model("qwen3_moe", "cuda")
    experts = model.model.layers[0].mlp.experts
    experts.config._experts_implementation = "poise"
    routings = random_routings(4, 8, torch.Generator().manual_seed(12)) + random_routings(
        2, 3, torch.Generator().manual_seed(13))
    poise_hf.configure(graph_max_tokens=0)
    without_graphs = decode_calls(experts, routings, "cuda")
    assert len(poise_hf.contexts.graphs) == 0
    poise_hf.configure(**DEFAULT_SETTINGS)
    with_graphs = decode_calls(experts, routings, "cuda")
    assert len(poise_hf.contexts.graphs) == 1  # one module, one context, one scores dtype
    for got, want in zip(with_graphs, without_graphs):
        assert torch.equal(got, want)

    x, ids, scores = routings[0]
    with torch.no_grad():
        experts.down_proj.mul_(2)  # in place: the same storage, read by the next replay
    (doubled,) = decode_calls(experts, [routings[0]], "cuda")
    assert torch.equal(doubled, 2 * with_graphs[0])
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach() / 2)  # new storage: captured again
    (halved,) = decode_calls(experts, [routings[0]], "cuda")
    assert torch.equal(halved, with_graphs[0])
    (again,) = decode_calls(experts, [routings[1]], "cuda")  # a replay of the new graph
    assert torch.equal(again, with_graphs[1])

    bad_ids = ids.clone()
    bad_ids[0, 0] = 8  # the model has experts 0..7
    decode_calls(experts, [(x, bad_ids, scores)], "cuda")
    torch.cuda.synchronize()  # the faulted replay has ended on the device
    with pytest.raises(poise.DeviceError):
        decode_calls(experts, [routings[1]], "cuda")


def test_routing_history_records_every_layer_of_every_pass(tmp_path):
    """configure(record_routing=True): one row per forward pass (recomputes in backward are not
    passes), one RoutingStats per MoE layer, counting each layer's tokens * top_k rows."""
    model = tiny_model("qwen3_moe")
    poise_hf.configure(record_routing=True)
    token_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    for _ in range(3):
        training_step(model, "poise", token_ids)
    history = poise_hf.routing_history()
    top_k = model.config.num_experts_per_tok
    assert [len(row) for row in history] == [model.config.num_hidden_layers] * 3
    for row in history:
        for stats in row:
            assert stats.expert_rows.sum().item() == 2 * 24 * top_k
    assert poise.plot_routing(history, tmp_path / "routing.png").read_bytes()[:4] == b"\x89PNG"
    poise_hf.configure(record_routing=False)
    assert poise_hf.routing_history() == []


def test_training_context_keeps_every_layer_of_a_pass():
    model = tiny_model("qwen3_moe")
    token_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    training_step(model, "poise", token_ids)
    (context,) = poise_hf.contexts._contexts.values()
    assert context.config.max_moe_layers_per_activation_slot == 2  # num_hidden_layers
    assert context.activation_slot == (0, 2)
    assert not context.config.inference


def test_unsupported_experts_are_named_not_run():
    model = tiny_model("qwen3_moe")
    model.model.layers[1].mlp.experts.act_fn = torch.nn.GELU()
    model.set_experts_implementation("poise")
    with pytest.raises(poise.NotAvailable, match="Qwen3MoeExperts.*the activation GELU"):
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("device", DEVICES)
def test_gpt_oss_training_step_matches_eager(device):
    """gpt-oss's experts (biases, gate and up interleaved, weights stored transposed, clamped SwiGLU),
    read as stored (weights_transposed, no copy on the GPU): logits and every gradient, the experts'
    biases' included, as close to "eager" as transformers' own grouped_mm is."""
    model = tiny_model("gpt_oss", device)
    token_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2)).to(device)
    grads_poise = assert_training_step_like_eager(model, token_ids)
    assert len(poise_hf.contexts) == 1  # every MoE layer ran on one shared training context
    experts = [n for n in grads_poise if ".experts." in n]
    assert len(experts) == 4 * model.config.num_hidden_layers  # weights and biases of every layer
    assert all(grads_poise[n].abs().sum() > 0 for n in experts)


def test_gpt_oss_experts_take_their_parameters_as_stored(monkeypatch):
    """No copy per call: poise.routed_experts gets gpt-oss's parameters themselves ([E, D, 2F] /
    [E, F, D] with weights_transposed=True, and the biases)."""
    model = tiny_model("gpt_oss")
    seen = []

    def spy(x_TD, ids_TK, scores_TK, w13, w2, context, **kwargs):
        seen.append((w13, w2, kwargs))
        return real(x_TD, ids_TK, scores_TK, w13, w2, context, **kwargs)

    real = poise_hf.routed_experts
    monkeypatch.setattr(poise_hf, "routed_experts", spy)
    model.set_experts_implementation("poise")
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert len(seen) == len(experts)
    for (w13, w2, kwargs), module in zip(seen, experts):
        assert w13 is module.gate_up_proj and w2 is module.down_proj
        assert kwargs["b13"] is module.gate_up_proj_bias and kwargs["b2"] is module.down_proj_bias
        assert kwargs["weights_transposed"] is True and kwargs["w13_layout"] == "gate_up_interleaved"


def test_a_float32_model_is_refused_naming_hidden_states():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.float32)
    model.set_experts_implementation("poise")
    with pytest.raises(poise.InvalidArgument, match="bfloat16") as raised:
        model(torch.zeros(1, 4, dtype=torch.long))
    assert raised.value.name == "hidden_states"


EXPERT_PARALLEL_WORKER = r"""
import sys
import torch
import torch.distributed as dist
sys.path.insert(0, {tests!r})
import poise.integrations.transformers as poise_hf
from test_transformers_backend import TOLERANCE, relative_error, tiny_model

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
batches = [torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]

# The reference: the whole model, eager, this rank's loss for non-expert grads, all ranks' for experts.
reference = tiny_model("qwen3_moe")
reference.set_experts_implementation("eager")
own_logits = reference(batches[rank]).logits.float()
reference(batches[rank], labels=batches[rank]).loss.backward()
own_grads = {{n: p.grad.clone() for n, p in reference.named_parameters()}}
for r in range(world):
    if r != rank:
        reference(batches[r], labels=batches[r]).loss.backward()
all_grads = {{n: p.grad.clone() for n, p in reference.named_parameters()}}

model = tiny_model("qwen3_moe")
poise_hf.configure(group=dist.group.WORLD, max_tokens=24)
model.set_experts_implementation("poise")
try:  # every expert on every rank: refused before any call, naming the weight
    model(batches[rank])
    raise SystemExit("an unsharded model ran over a group")
except poise_hf.InvalidArgument as error:
    assert error.name == "gate_up_proj" and "shard_experts" in str(error), error
assert poise_hf.shard_experts(model, dist.group.WORLD) == 2
poise_hf.configure(group=dist.group.WORLD, max_tokens=24)
model.set_experts_implementation("poise")
out = model(batches[rank], labels=batches[rank])
out.loss.backward()
assert relative_error(out.logits.float(), own_logits) < TOLERANCE, "logits"
local = 8 // world
for name, p in model.named_parameters():
    if "experts." in name:
        want = all_grads[name][rank * local:(rank + 1) * local]
    else:
        want = own_grads[name]
    assert p.shape == want.shape, name
    error = relative_error(p.grad.float(), want.float())
    assert error < TOLERANCE, (name, error)
print(f"rank {{rank}} of {{world}}: sharded experts match the whole eager model", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_expert_parallel_over_a_group_matches_the_whole_model(tmp_path):
    """2 processes (gloo, CPU engine): each keeps 4 of 8 experts per layer (shard_experts) and its own
    batch; logits match the whole eager model, expert grads are the sum of both ranks' losses'."""
    import pathlib
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(EXPERT_PARALLEL_WORKER.format(tests=str(pathlib.Path(__file__).parent)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for rank in range(2):
        assert f"rank {rank} of 2: sharded experts match the whole eager model" in result.stdout
