"""poise.torch: the routed experts as PyTorch ops. Importing it registers the ops
``torch.ops.poise.*`` and their autograd (needed before loading a graph that contains them).

Modules, each one idea, bottom up:

- checks.py: host-side checks of a call's arguments (poise.InvalidArgument naming the argument).
- saved_state.py: how an engine finds the forward a backward belongs to.
- cuda_engine.py, cpu_engines.py, engines.py: what executes a call (the engine behind a context).
- ops.py: the torch.library ops and their fake (meta) implementations.
- autograd.py: the ops' backward, and the plain-eager bypass of torch.library's dispatch.
- api.py: poise.routed_experts and poise.routed_experts_virtual.
- fp8_weights.py: poise.prepare_weights (FP8 block-scaled expert weights).

See docs/pytorch.md.
"""

from .api import routed_experts, routed_experts_virtual
from .fp8_weights import PreparedWeights, prepare_weights

__all__ = ["PreparedWeights", "prepare_weights", "routed_experts", "routed_experts_virtual"]
