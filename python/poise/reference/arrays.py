"""Tensors across the numpy boundary of the C++ reference (poise._poise.ReferenceEngine and the
float64 oracle), which takes float32 arrays: bf16 values are exact in float32, so nothing is rounded
on the way in."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def float32_array(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def int32_array(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def tensor_from_array(array: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return torch.from_numpy(array).reshape(shape).to(dtype)


def input_arrays(x_TD, ids_TK, scores_TK, w13, w2, b13=None, b2=None) -> list[list[np.ndarray]]:
    """Per input, the arrays of every rank (each argument a list of one tensor per rank), the
    engine's order: x, ids, scores, w13, w2, b13, b2 (the biases' lists empty without biases)."""
    return [[float32_array(t) for t in x_TD], [int32_array(t) for t in ids_TK],
            [float32_array(t) for t in scores_TK], [float32_array(t) for t in w13], [float32_array(t) for t in w2],
            [float32_array(t) for t in b13 or []], [float32_array(t) for t in b2 or []]]


def write_back(target: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """The engine's accumulated values (already in wgrad_dtype) into the caller's tensor, in place."""
    with torch.no_grad():
        target.copy_(torch.from_numpy(values).reshape(target.shape))
    return target


def clip_counts_tensor(counts: Sequence[int]) -> torch.Tensor:
    """One rank's clip counts from the engine: int64 [E_local, 2]."""
    return torch.tensor(list(counts), dtype=torch.int64).reshape(-1, 2)
