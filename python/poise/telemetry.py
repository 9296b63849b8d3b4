"""Routing telemetry: where a forward's rows went (``Context.routing_stats()``), and a plot of it
over training steps (``plot_routing``).

The stats of a GPU context are device tensors written on the current stream without a host sync
(safe inside a training step and under CUDA graphs); reading a value synchronizes, as any tensor.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Sequence, Union

from .errors import InvalidArgument, NotAvailable


@dataclasses.dataclass(frozen=True)
class RoutingStats:
    """One forward's routing on one rank: int32 tensors on the context's device.

    ``expert_rows`` [E]: rows routed to each expert by every rank (entries of id -1 excluded);
    ``owner_rows`` [ep_size]: rows of each rank's own experts, its load before balancing;
    ``computed_rows`` [ep_size]: rows each rank computes under the balance plan (after);
    ``replicas`` [ep_size]: replica slots each rank fills (exact balance); ``received_token_rows``
    []: token rows dispatched to this rank, a token once however many of its experts live here.
    """

    expert_rows: Any
    owner_rows: Any
    computed_rows: Any
    replicas: Any
    received_token_rows: Any
    hidden_dim: int

    @property
    def owner_peak_over_mean(self) -> Any:
        """max / mean of owner_rows (1 = balanced before balancing; 0 when no row was routed)."""
        return peak_over_mean(self.owner_rows)

    @property
    def computed_peak_over_mean(self) -> Any:
        """max / mean of computed_rows: what the ranks' loads were after balancing."""
        return peak_over_mean(self.computed_rows)

    @property
    def received_bytes(self) -> Any:
        """int64: the bytes of the token rows dispatched to this rank (bf16 rows of hidden_dim)."""
        return self.received_token_rows.long() * (2 * self.hidden_dim)


def peak_over_mean(rows: Any) -> Any:
    """max / mean of a per-rank row tensor as a float32 tensor (0 when all are empty), no sync."""
    import torch

    rows = rows.float()
    mean = rows.mean()
    return torch.where(mean > 0, rows.max() / mean.clamp_min(1e-30), torch.zeros_like(mean))


def stats_from_layout(expert_rows, owner_rows, computed_rows, replicas, received_token_rows, hidden_dim: int,
                      device: Any = "cpu") -> RoutingStats:
    """RoutingStats from sequences of ints (the CPU reference engine's RoutingStats)."""
    import torch

    def tensor(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return RoutingStats(tensor(list(expert_rows)), tensor(list(owner_rows)), tensor(list(computed_rows)),
                        tensor(list(replicas)), tensor(int(received_token_rows)), hidden_dim)


def plot_routing(history: Sequence[Sequence[RoutingStats]], path: Union[str, pathlib.Path], *,
                 title: str = "Routing") -> pathlib.Path:
    """Writes a PNG of ``history[step][layer]`` (RoutingStats of each MoE layer at each step): per layer
    a heatmap of the rows each expert received over the steps, and the ranks' peak/mean rows before
    (solid) and after (dashed) balancing over the steps. Needs matplotlib. Returns the path."""
    if not history or not history[0]:
        raise InvalidArgument("history", "needs at least one step with at least one layer's RoutingStats")
    layers = len(history[0])
    for step, row in enumerate(history):
        if len(row) != layers or not all(isinstance(s, RoutingStats) for s in row):
            raise InvalidArgument("history", f"step {step} holds {len(row)} entries, not {layers} RoutingStats")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise NotAvailable("plot_routing needs matplotlib (pip install matplotlib)") from error
    import torch

    loads = [torch.stack([history[s][l].expert_rows.cpu() for s in range(len(history))]).T.numpy()
             for l in range(layers)]  # [E, steps] per layer
    figure, axes = plt.subplots(layers + 1, 1, figsize=(8, 2.5 * (layers + 1)), squeeze=False)
    for l, load in enumerate(loads):
        ax = axes[l][0]
        image = ax.imshow(load, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set(title=f"layer {l}: rows per expert", xlabel="step", ylabel="expert")
        figure.colorbar(image, ax=ax)
    ax = axes[layers][0]
    steps = range(len(history))
    for l in range(layers):
        before = [history[s][l].owner_peak_over_mean.item() for s in steps]
        after = [history[s][l].computed_peak_over_mean.item() for s in steps]
        line, = ax.plot(steps, before, label=f"layer {l} before balancing")
        ax.plot(steps, after, linestyle="--", color=line.get_color(), label=f"layer {l} after")
    ax.set(title="peak / mean rows per rank", xlabel="step", ylabel="peak / mean")
    ax.legend(fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    path = pathlib.Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
