"""Poise as a Hugging Face transformers experts implementation.

Importing this module registers "poise" in transformers' ``ExpertsInterface``; then

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, experts_implementation="poise")
    model.set_experts_implementation("poise")  # or on a model already built

runs every Experts module through ``poise.routed_experts`` on the module's own parameters, as
stored (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``, or gpt-oss's transposed ``[E, D, 2F]``
/ ``[E, F, D]`` with ``weights_transposed=True``), so no copy is made on the GPU.

Contexts are created on first use and shared by every layer of one shape on one device (see
``ContextCache``); a call of n tokens runs on the context of the smallest bucket >= n (the rows past
n are padding with expert ids -1: never computed, they add nothing and get no gradient). ``configure`` sets the largest
call and the engine options. Training uses one context per shape whose activation slot holds every
MoE layer of a forward, so each layer's backward runs from what its forward kept.

Expert parallelism: ``shard_experts(model, group)`` keeps each rank's E / ep_size experts and runs
the contexts over the group (docs/transformers.md).

gpt-oss's experts (biases, gate and up interleaved, weights stored transposed [E, D, 2F] /
[E, F, D], the clamped SwiGLU) run through the same call with b13 / b2 and weights_transposed=True,
on the GPU and on CPU contexts (whose reference engine copies the weights into its own layout).
Not built: experts without a gate, post-expert norms, other custom gates and activations,
transformers' own expert sharding; such a module raises poise.NotAvailable naming what it lacks
(docs/transformers.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from ..config import Config
from ..context import Context, create_context
from ..errors import InvalidArgument, NotAvailable
from ..torch import routed_experts

IMPLEMENTATION_NAME = "poise"


@dataclasses.dataclass(kw_only=True)
class Settings:
    """What the "poise" experts implementation runs with (``configure`` replaces it)."""

    max_tokens: int = 16384
    """The most tokens one Experts call may hold (batch x sequence of one forward)."""
    min_bucket_tokens: int = 64
    """The smallest context: calls of fewer tokens are padded to it (decode steps)."""
    buckets_per_octave: int = 4
    """Context sizes between two powers of two: padding is then at most 1/buckets_per_octave."""
    balance: str = "exact"
    moe_layers: Optional[int] = None
    """MoE layers per forward kept for backward; None: the model config's num_hidden_layers."""
    sync_check: bool = False
    record_routing: bool = False
    """Keep every Experts call's poise.RoutingStats (device tensors, no sync), one row per forward
    pass: ``routing_history()``, e.g. for ``poise.plot_routing``."""
    graph_max_tokens: int = 256
    """GPU inference calls on a context of at most this many tokens (decode steps) replay a CUDA graph
    of the call, one per Experts module, captured after its first call: a layer's host time is then
    the copies in and out and one replay instead of the call's launches (``CallGraphs``). 0: never.
    Not with a group or sync_check, nor inside a graph the caller captures."""
    group: Any = None
    """A torch.distributed group: expert parallelism over its ranks, each holding E / ep_size experts
    (``shard_experts``). Every call then runs on the max_tokens context on every rank, so that the
    ranks' calls, which are collective, agree without a host sync (the padding rows name no
    expert, so they cost nothing)."""


_settings = Settings()


def configure(**fields) -> Settings:
    """Replaces the named settings (``Settings``'s fields), drops every cached context and the
    routing history."""
    global _settings
    _settings = dataclasses.replace(_settings, **fields)
    contexts.release()
    recorder.clear()
    return _settings


def bucket_tokens(num_tokens: int, settings: Settings) -> int:
    """The context size for a call of ``num_tokens``: the smallest bucket >= num_tokens."""
    if num_tokens > settings.max_tokens:
        raise InvalidArgument("hidden_states", f"holds {num_tokens} tokens, more than the configured max_tokens="
                                               f"{settings.max_tokens}: call poise.integrations.transformers."
                                               "configure(max_tokens=...) before the first call")
    if settings.group is not None:
        return settings.max_tokens
    if num_tokens <= settings.min_bucket_tokens:
        return settings.min_bucket_tokens
    octave = 1 << (num_tokens - 1).bit_length() - 1  # the power of two below num_tokens
    step = max(1, octave // settings.buckets_per_octave)
    return min(-(-num_tokens // step) * step, settings.max_tokens)


class CallGraphs:
    """Inference calls replayed as CUDA graphs (Settings.graph_max_tokens). A decode step calls each
    layer with a few tokens, and its time is host time: the call's kernel launches are most of it.
    The call reads only buffers whose addresses stay: the context's, its padded inputs (PaddedInputs)
    and the module's weights. So each module's first call on a context runs as it is (it also makes
    the context allocate) and is then captured once; later calls copy their rows in, replay it and
    copy the rows of its output out. Weights are read where they are at each replay (in-place updates
    are seen); weights moved to new storage are captured again. A replay runs none of the call's host
    code, so the fault check of the call's entry is made here (``Context.raise_if_faulted``)."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[int, ...], Tensor]] = {}

    def run(self, slot: tuple, context: Context, weights: tuple[Tensor, ...], call: Callable[[], Tensor],
            rows: int) -> Tensor:
        """``call()``'s first ``rows`` rows, from the graph of ``slot`` (module, context key, scores
        dtype) when one was captured on these ``weights``."""
        addresses = tuple(w.data_ptr() for w in weights)
        captured = self._graphs.get(slot)
        if captured is not None and captured[1] == addresses:
            graph, _, out_TD = captured
            context.raise_if_faulted()
            graph.replay()
            return out_TD[:rows].clone()
        out_TD = call()
        self._graphs[slot] = self._captured(call, out_TD.device, addresses)
        return out_TD[:rows]

    def _captured(self, call: Callable[[], Tensor], device: torch.device, addresses: tuple[int, ...]):
        graph = torch.cuda.CUDAGraph()
        # Captured outside inference mode: the output it keeps is read by later calls under no_grad too.
        with (torch.cuda.device(device), torch.inference_mode(False), torch.no_grad(),
              torch.cuda.graph(graph, capture_error_mode="thread_local")):
            out_TD = call()
        return graph, addresses, out_TD

    def clear(self) -> None:
        self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)


class ContextCache:
    """Contexts keyed by (layer shape, device, tokens, training): one serves every layer of that key.

    A training context's one activation slot keeps ``moe_layers`` layers; the first layer of each
    forward pass (the layer that opened the first pass, seen again outside a backward) selects the
    slot afresh, so layer i of the pass keeps its state at position i."""

    def __init__(self) -> None:
        self._contexts: dict[tuple, Context] = {}
        self._pass_opener: dict[tuple, int] = {}
        self._inference_inputs: dict[tuple, PaddedInputs] = {}
        self.graphs = CallGraphs()  # they read the contexts' buffers: released before them

    def get(self, key: tuple, make_config: Callable[[], Config], device: str) -> Context:
        """The context of ``key``; on the first call of a key, created from ``make_config()``."""
        context = self._contexts.get(key)
        if context is None:
            context = create_context(config=make_config(), device=device, group=_settings.group,
                                     sync_check=_settings.sync_check)
            self._contexts[key] = context
        return context

    def open_pass_if_first_layer(self, key: tuple, context: Context, module: torch.nn.Module) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute inside backward (activation checkpointing): runs from the working buffers
        opener = self._pass_opener.setdefault(key, id(module))
        if opener == id(module):
            context.select_activation_slot(0, context.config.max_moe_layers_per_activation_slot)

    def inference_inputs(self, key: tuple, hidden_states: Tensor, top_k_index: Tensor, scores_dtype: torch.dtype,
                         tokens: int) -> "PaddedInputs":
        """The padded input buffers of inference calls of ``key`` with scores of ``scores_dtype``."""
        buffers = self._inference_inputs.get((key, scores_dtype))
        if buffers is None:
            buffers = PaddedInputs(tokens, hidden_states.shape[1], top_k_index.shape[1], scores_dtype,
                                   hidden_states.device)
            self._inference_inputs[(key, scores_dtype)] = buffers
        return buffers

    def release(self) -> None:
        self.graphs.clear()
        for context in self._contexts.values():
            context.close()
        self._contexts.clear()
        self._pass_opener.clear()
        self._inference_inputs.clear()

    def __len__(self) -> int:
        return len(self._contexts)


contexts = ContextCache()


class RoutingRecorder:
    """With ``record_routing``: each Experts call's RoutingStats, ``steps[pass][layer]``. A pass opens
    when the first module it saw is called again; recomputes inside backward are not recorded."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []
        self._layers: dict[int, int] = {}

    def record(self, module: torch.nn.Module, context: Context) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        layer = self._layers.setdefault(id(module), len(self._layers))
        if layer == 0 or not self.steps:
            self.steps.append([])
        self.steps[-1].append(context.routing_stats())

    def clear(self) -> None:
        self.steps, self._layers = [], {}


recorder = RoutingRecorder()


def routing_history() -> list[list[Any]]:
    """The recorded poise.RoutingStats (``configure(record_routing=True)``): ``[forward pass][MoE
    layer]``, the shape ``poise.plot_routing`` takes. A generation records one pass per step."""
    return recorder.steps


def poise_experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "poise" implementation of a transformers Experts module's forward."""
    form = _experts_form(module)
    _check_inputs(hidden_states, top_k_index)
    num_tokens, top_k = top_k_index.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    tokens = bucket_tokens(num_tokens, _settings)
    biases = dict(b13=module.gate_up_proj_bias, b2=module.down_proj_bias) if form.biased else {}
    w13, w2 = module.gate_up_proj, module.down_proj  # as stored: no copy
    training = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_states, top_k_weights, w13, w2, *biases.values()))
    layers = (_settings.moe_layers or getattr(module.config, "num_hidden_layers", 1)) if training else 1
    device = _device_name(hidden_states.device)
    # Everything the layer's Config depends on: built (and checked) once per key, not per call.
    key = (tuple(w13.shape), form.transposed, getattr(module, "num_experts", None), top_k, tokens, training, layers,
           device, form.activation)
    context = contexts.get(key, lambda: _layer_config(module, w13, form, tokens, top_k, training, layers), device)
    if training:
        contexts.open_pass_if_first_layer(key, context, module)
    compiling = torch.compiler.is_compiling()
    graphed = not training and not compiling and _replays_graphs(tokens, hidden_states.device)
    if training or compiling or (tokens == num_tokens and not graphed):
        x_TD, ids_TK, scores_TK = _padded(hidden_states, top_k_index, top_k_weights, tokens)
    else:
        inputs = contexts.inference_inputs(key, hidden_states, top_k_index, _scores_dtype(top_k_weights), tokens)
        x_TD, ids_TK, scores_TK = inputs.fill(hidden_states, top_k_index, top_k_weights)

    def call() -> Tensor:
        return routed_experts(x_TD, ids_TK, scores_TK, w13, w2, context, w13_layout=form.w13_layout,
                              weights_transposed=form.transposed, **biases)

    if graphed:
        out_TD = contexts.graphs.run((id(module), key, scores_TK.dtype), context, (w13, w2, *biases.values()), call,
                                     num_tokens)
    else:
        out_TD = call()[:num_tokens]
    if _settings.record_routing:
        recorder.record(module, context)
    return out_TD


def _replays_graphs(tokens: int, device: torch.device) -> bool:
    """Whether an inference call of a ``tokens`` context replays a graph (Settings.graph_max_tokens)."""
    return (device.type == "cuda" and tokens <= _settings.graph_max_tokens and _settings.group is None
            and not _settings.sync_check and not torch.cuda.is_current_stream_capturing())


def _layer_config(module: torch.nn.Module, w13: torch.Tensor, form: "ExpertsForm", tokens: int, top_k: int,
                  training: bool, layers: int) -> Config:
    local_experts, two_f, hidden_dim = w13.shape
    if form.transposed:  # [E, D, 2F]
        hidden_dim, two_f = two_f, hidden_dim
    ep_size = _ep_size_and_rank(_settings.group)[0]
    num_experts = local_experts * ep_size
    expected = getattr(module, "num_experts", num_experts)
    if num_experts != expected:
        raise InvalidArgument("gate_up_proj", f"holds {local_experts} experts on each of {ep_size} ranks, but the "
                                              f"model has {expected}: shard_experts(model, group) keeps each rank's")
    activation, alpha, limit = form.activation
    clamp = dict(swiglu_alpha=alpha, swiglu_limit=limit) if activation == "swiglu_clamped" else {}
    return Config(num_local_input_tokens=tokens, hidden_dim=hidden_dim, intermediate_dim=two_f // 2,
                  top_k=top_k, num_experts=num_experts, balance=_settings.balance, inference=not training,
                  max_moe_layers_per_activation_slot=layers, activation=activation, **clamp)


def _scores_dtype(top_k_weights: Tensor) -> torch.dtype:
    return top_k_weights.dtype if top_k_weights.dtype in (torch.bfloat16, torch.float32) else torch.float32


def _padded(hidden_states, top_k_index, top_k_weights, tokens: int):
    """The call's rows, then padding rows up to ``tokens`` whose expert ids are -1 (no expert): they
    are not dispatched or computed, so padding costs nothing but its bytes of x. New tensors, as
    autograd keeps them for the backward (inference calls use PaddedInputs)."""
    pad = tokens - top_k_index.shape[0]
    ids_TK = top_k_index.to(torch.int32)
    scores_TK = top_k_weights.to(_scores_dtype(top_k_weights))
    if pad == 0:
        return hidden_states.contiguous(), ids_TK.contiguous(), scores_TK.contiguous()
    return (torch.nn.functional.pad(hidden_states, (0, 0, 0, pad)),
            torch.nn.functional.pad(ids_TK, (0, 0, 0, pad), value=-1),
            torch.nn.functional.pad(scores_TK, (0, 0, 0, pad)))


class PaddedInputs:
    """An inference context's padded inputs, kept between calls: each call copies its rows in (three
    copies, no allocation), and the padding rows keep ids of -1, so their x and scores are never read.
    At decode the host time per layer is what a step costs: a new padded set took seven kernels and
    three allocations. Calls run in stream order (as the context's do), so a copy never overtakes
    the previous call's reads."""

    def __init__(self, tokens: int, hidden: int, top_k: int, scores_dtype: torch.dtype, device: torch.device):
        # Normal tensors even when the first call runs under torch.inference_mode(): an inference
        # tensor could not be written by a later call outside it.
        with torch.inference_mode(False):
            self.x_TD = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)
            self.ids_TK = torch.full((tokens, top_k), -1, dtype=torch.int32, device=device)
            self.scores_TK = torch.zeros(tokens, top_k, dtype=scores_dtype, device=device)
        self._rows = 0  # rows the last call wrote: those past the next call's are reset to -1

    def fill(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows = top_k_index.shape[0]
        if rows < self._rows:
            self.ids_TK[rows:self._rows].fill_(-1)
        self._rows = rows
        self.x_TD[:rows].copy_(hidden_states)
        self.ids_TK[:rows].copy_(top_k_index)
        self.scores_TK[:rows].copy_(top_k_weights)
        return self.x_TD, self.ids_TK, self.scores_TK


@dataclasses.dataclass(frozen=True)
class ExpertsForm:
    """How an Experts module computes, in Poise's terms."""

    activation: tuple  # (Config.activation, swiglu_alpha, swiglu_limit)
    w13_layout: str    # gate and up rows: "gate_up_blocked" or "gate_up_interleaved"
    transposed: bool   # weights stored [E, D, 2F] / [E, F, D] (gpt-oss)
    biased: bool       # gate_up_proj_bias / down_proj_bias


def _experts_form(module: torch.nn.Module) -> ExpertsForm:
    """What the experts compute, which must be what Poise computes: SwiGLU experts (plain, or gpt-oss's
    clamped form), without norms; poise.NotAvailable names what is not built."""
    missing = [what for what, lacks in (
        ("a gate projection (has_gate=False)", not module.has_gate),
        ("a post-expert norm", getattr(module, "has_post_expert_norm", False)),  # transformers >= 5.2x
        ("transformers' expert parallelism", getattr(module, "_is_expert_parallel", False)),
    ) if lacks]
    gate = type(module)._apply_gate
    activation = None
    if gate is _default_apply_gate:
        act_fn = getattr(module, "act_fn", None)
        if isinstance(act_fn, (torch.nn.SiLU, SiLUActivation)):
            activation = ("swiglu", None, None)
        else:
            missing.append(f"the activation {type(act_fn).__name__} (Poise runs SiLU-gated experts)")
    elif gate is _gpt_oss_gate():
        activation = ("swiglu_clamped", float(module.alpha), float(module.limit))
    else:
        missing.append("a custom gate function (_apply_gate)")
    if missing:
        raise NotAvailable(f"experts_implementation='poise' for {type(module).__name__}: not built for "
                           + "; ".join(missing))
    return ExpertsForm(activation, "gate_up_blocked" if module.is_concatenated else "gate_up_interleaved",
                       bool(module.is_transposed), bool(module.has_bias))


@functools.cache
def _gpt_oss_gate():
    """gpt-oss's gate (gate and up interleaved, clamped SwiGLU with the module's alpha and limit)."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return None
    return GptOssExperts._apply_gate


def _check_inputs(hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> None:
    if hidden_states.dtype != torch.bfloat16:
        raise InvalidArgument("hidden_states", f"must be bfloat16 (load the model with dtype=torch.bfloat16), "
                                               f"got {hidden_states.dtype}")
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        raise InvalidArgument("hidden_states", f"must be [tokens, hidden] with top_k_index [tokens, top_k], got "
                                               f"{tuple(hidden_states.shape)} and {tuple(top_k_index.shape)}")


def _device_name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{device.index if device.index is not None else 0}"


def _ep_size_and_rank(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def shard_experts(model: torch.nn.Module, group: Any) -> int:
    """Keeps this rank's experts of every Experts module: rank r of ``group`` keeps global experts
    [r * E / ep_size, (r+1) * E / ep_size), as new parameters (build optimizers afterwards). Also sets
    ``configure(group=group)``. Returns the number of modules sharded.

    Load as usual on every rank (on the CPU, or with ``device_map="meta"`` then materialize), call
    this, then move the model to the rank's GPU: each GPU holds its share of the experts and the
    whole rest of the model. Expert gradients are then rank-local (not to be averaged over the EP
    group); the other parameters' are averaged as in data parallelism."""
    ep_size, rank = _ep_size_and_rank(group)
    sharded = 0
    for module in model.modules():
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "has_gate")):
            continue
        num_experts = module.gate_up_proj.shape[0]
        if num_experts % ep_size:
            raise InvalidArgument("group", f"{num_experts} experts do not split over {ep_size} ranks")
        local = num_experts // ep_size
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            weight = getattr(module, name, None)
            if weight is None:
                continue
            setattr(module, name, torch.nn.Parameter(weight.data[rank * local:(rank + 1) * local].clone(),
                                                     requires_grad=weight.requires_grad))
        module.num_experts = num_experts
        sharded += 1
    configure(group=group)
    return sharded


def register() -> None:
    """Makes "poise" a valid ``experts_implementation`` (done on import; calling again is harmless)."""
    ExpertsInterface.register(IMPLEMENTATION_NAME, poise_experts_forward)


register()
