"""poise.prepare_weights: FP8 block-scaled expert weights (docs/fp8.md "Weights").

The E4M3 values keep the weights' shapes (torch.float8_e4m3fn), with one fp32 scale per 128 x 128
block of each expert's matrix (W13 [2F, D], W2 [D, F]), DeepSeek-V3's recipe. On a GPU one kernel
per matrix kind, on the current stream, no sync; ``out=`` refills caller-owned buffers in place
(after an optimizer step; no allocation, capturable in a CUDA graph). On the CPU the reference's
quantization, which the GPU's equals bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import _poise
from ..errors import InvalidArgument

FORMATS = ("fp8_e4m3",)
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class PreparedWeights:
    """FP8 expert weights: ``w13`` / ``w2`` torch.float8_e4m3fn in the bf16 weights' shapes;
    ``w13_scales`` fp32 [E_local, ceil(2F/128), ceil(D/128)], ``w2_scales`` fp32 [E_local,
    ceil(D/128), ceil(F/128)] (value = e4m3 * scale)."""

    format: str
    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def prepare_weights(w13: torch.Tensor, w2: torch.Tensor, *, format: str = "fp8_e4m3",
                    out: Optional[PreparedWeights] = None) -> PreparedWeights:
    """Quantizes bf16 expert weights, w13 [E_local, 2F, D] (or [E_local, 2, F, D]) and w2 [E_local,
    D, F], to ``format`` (``"fp8_e4m3"``): a new PreparedWeights, or ``out`` refilled in place.
    Raises poise.InvalidArgument naming the argument before any kernel runs."""
    if format not in FORMATS:
        raise InvalidArgument("format", f"must be one of {', '.join(FORMATS)}, got {format!r}")
    dims = {"w13": _matrix_dims("w13", w13, (3, 4)), "w2": _matrix_dims("w2", w2, (3,))}
    if w2.device != w13.device:
        raise InvalidArgument("w2", f"must be on w13's device {w13.device}, got {w2.device}")
    if dims["w2"][0] != dims["w13"][0]:
        raise InvalidArgument("w2", f"holds {dims['w2'][0]} experts, w13 {dims['w13'][0]}")
    wanted = _allocate(format, w13, w2, dims) if out is None else _check_out(out, format, w13, w2, dims)
    for name, weight in (("w13", w13), ("w2", w2)):
        _quantize(weight.detach(), dims[name], getattr(wanted, name), getattr(wanted, f"{name}_scales"))
    return wanted


def _matrix_dims(name: str, w: torch.Tensor, ranks: tuple[int, ...]) -> tuple[int, int, int]:
    """(matrices, rows, cols) of an expert weight tensor, checked."""
    if not isinstance(w, torch.Tensor):
        raise InvalidArgument(name, f"must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype != torch.bfloat16:
        raise InvalidArgument(name, f"must be torch.bfloat16, got {w.dtype}")
    if w.dim() not in ranks:
        raise InvalidArgument(name, f"must have {' or '.join(map(str, ranks))} dimensions (experts first), got "
                                    f"{list(w.shape)}")
    if not w.is_contiguous():
        raise InvalidArgument(name, "must be contiguous (call .contiguous())")
    matrices, cols = w.shape[0], w.shape[-1]
    rows = w.numel() // max(1, matrices * cols)
    if matrices < 1 or rows < 64 or rows % 64 or cols < 64 or cols % 64:
        raise InvalidArgument(name, f"needs experts >= 1 and matrix dims that are positive multiples of 64, got "
                                    f"{list(w.shape)}")
    return matrices, rows, cols


def scales_shape(dims: tuple[int, int, int]) -> tuple[int, int, int]:
    """The block scales' shape of `matrices` [rows, cols] matrices: [matrices, ceil(rows/128), ceil(cols/128)]."""
    matrices, rows, cols = dims
    return matrices, -(-rows // BLOCK), -(-cols // BLOCK)


def _allocate(format: str, w13, w2, dims) -> PreparedWeights:
    def values(w):
        return torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)

    def scales(name, w):
        return torch.empty(scales_shape(dims[name]), dtype=torch.float32, device=w.device)

    return PreparedWeights(format, values(w13), scales("w13", w13), values(w2), scales("w2", w2))


def _check_out(out, format: str, w13, w2, dims) -> PreparedWeights:
    if not isinstance(out, PreparedWeights):
        raise InvalidArgument("out", f"must be a poise.PreparedWeights, got {type(out).__name__}")
    if out.format != format:
        raise InvalidArgument("out", f"holds format {out.format!r}, not {format!r}")
    for name, w in (("w13", w13), ("w2", w2)):
        expected = {name: (tuple(w.shape), torch.float8_e4m3fn),
                    f"{name}_scales": (scales_shape(dims[name]), torch.float32)}
        for field, (shape, dtype) in expected.items():
            t = getattr(out, field)
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != w.device or not t.is_contiguous():
                raise InvalidArgument("out", f"{field} must be a contiguous {dtype} {list(shape)} on {w.device}, got "
                                             f"{t.dtype} {list(t.shape)} on {t.device}")
    return out


def _quantize(w: torch.Tensor, dims: tuple[int, int, int], values: torch.Tensor, scales: torch.Tensor) -> None:
    if w.device.type == "cuda":
        stream = torch.cuda.current_stream(w.device).cuda_stream
        _poise.quantize_fp8_weight_blocks(w.data_ptr(), *dims, values.data_ptr(), scales.data_ptr(), stream)
        return
    bits, block_scales = _poise.reference_quantize_fp8_weight_blocks(w.float().reshape(-1).numpy(), *dims)
    values.view(torch.uint8).copy_(torch.from_numpy(bits).view(values.shape))
    scales.copy_(torch.from_numpy(block_scales).view(scales.shape))
