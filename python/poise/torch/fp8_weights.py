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
    ceil(D/128), ceil(F/128)] (value = e4m3 * scale). With ``transposed=True`` also the backward's
    copies, each expert's matrix transposed (the same blocks: DGRAD reads them instead of quantizing
    its own per call): ``w13_t`` [E_local, D, 2F] with ``w13_t_scales`` [E_local, ceil(D/128),
    ceil(2F/128)], ``w2_t`` [E_local, F, D] with ``w2_t_scales`` [E_local, ceil(F/128), ceil(D/128)];
    else None."""

    format: str
    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor
    w13_t: Optional[torch.Tensor] = None
    w13_t_scales: Optional[torch.Tensor] = None
    w2_t: Optional[torch.Tensor] = None
    w2_t_scales: Optional[torch.Tensor] = None

    @property
    def transposed(self) -> bool:
        return self.w13_t is not None


def prepare_weights(w13: torch.Tensor, w2: torch.Tensor, *, format: str = "fp8_e4m3", transposed: bool = False,
                    out: Optional[PreparedWeights] = None) -> PreparedWeights:
    """Quantizes bf16 expert weights, w13 [E_local, 2F, D] (or [E_local, 2, F, D]) and w2 [E_local,
    D, F], to ``format`` (``"fp8_e4m3"``): a new PreparedWeights, or ``out`` refilled in place.
    ``transposed=True`` also quantizes the backward's transposed copies (for training with several
    micro-batches per optimizer step: the backward then quantizes nothing per call; 3 F D more bytes
    per expert). Raises poise.InvalidArgument naming the argument before any kernel runs."""
    if format not in FORMATS:
        raise InvalidArgument("format", f"must be one of {', '.join(FORMATS)}, got {format!r}")
    if not isinstance(transposed, bool):
        raise InvalidArgument("transposed", f"must be a bool, got {type(transposed).__name__}")
    dims = {"w13": _matrix_dims("w13", w13, (3, 4)), "w2": _matrix_dims("w2", w2, (3,))}
    if w2.device != w13.device:
        raise InvalidArgument("w2", f"must be on w13's device {w13.device}, got {w2.device}")
    if dims["w2"][0] != dims["w13"][0]:
        raise InvalidArgument("w2", f"holds {dims['w2'][0]} experts, w13 {dims['w13'][0]}")
    wanted = (_allocate(format, w13, w2, dims, transposed) if out is None
              else _check_out(out, format, w13, w2, dims, transposed))
    for name, weight in (("w13", w13), ("w2", w2)):
        _quantize(weight.detach(), dims[name], getattr(wanted, name), getattr(wanted, f"{name}_scales"))
        if transposed:
            _quantize(weight.detach(), dims[name], getattr(wanted, f"{name}_t"), getattr(wanted, f"{name}_t_scales"),
                      transposed=True)
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


def transposed_dims(dims: tuple[int, int, int]) -> tuple[int, int, int]:
    """(matrices, cols, rows): each matrix transposed."""
    matrices, rows, cols = dims
    return matrices, cols, rows


def _expected(name: str, w, dims, transposed: bool) -> dict:
    """The PreparedWeights fields of one weight: {field: (shape, dtype)}."""
    fields = {name: (tuple(w.shape), torch.float8_e4m3fn), f"{name}_scales": (scales_shape(dims), torch.float32)}
    if transposed:
        fields[f"{name}_t"] = (transposed_dims(dims), torch.float8_e4m3fn)
        fields[f"{name}_t_scales"] = (scales_shape(transposed_dims(dims)), torch.float32)
    return fields


def _allocate(format: str, w13, w2, dims, transposed: bool) -> PreparedWeights:
    tensors = {field: torch.empty(shape, dtype=dtype, device=w.device)
               for name, w in (("w13", w13), ("w2", w2)) for field, (shape, dtype) in
               _expected(name, w, dims[name], transposed).items()}
    return PreparedWeights(format, **tensors)


def _check_out(out, format: str, w13, w2, dims, transposed: bool) -> PreparedWeights:
    if not isinstance(out, PreparedWeights):
        raise InvalidArgument("out", f"must be a poise.PreparedWeights, got {type(out).__name__}")
    if out.format != format:
        raise InvalidArgument("out", f"holds format {out.format!r}, not {format!r}")
    if out.transposed != transposed:
        raise InvalidArgument("out", f"{'holds no' if transposed else 'holds'} transposed copies: prepare it with "
                                     f"transposed={transposed}")
    for name, w in (("w13", w13), ("w2", w2)):
        expected = _expected(name, w, dims[name], transposed)
        for field, (shape, dtype) in expected.items():
            t = getattr(out, field)
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != w.device or not t.is_contiguous():
                raise InvalidArgument("out", f"{field} must be a contiguous {dtype} {list(shape)} on {w.device}, got "
                                             f"{t.dtype} {list(t.shape)} on {t.device}")
    return out


def _quantize(w: torch.Tensor, dims: tuple[int, int, int], values: torch.Tensor, scales: torch.Tensor,
              transposed: bool = False) -> None:
    """w's blocks into values / scales, or with ``transposed`` each matrix's blocks transposed."""
    if w.device.type == "cuda":
        stream = torch.cuda.current_stream(w.device).cuda_stream
        kernel = _poise.quantize_fp8_weight_blocks_transposed if transposed else _poise.quantize_fp8_weight_blocks
        kernel(w.data_ptr(), *dims, values.data_ptr(), scales.data_ptr(), stream)
        return
    bits, block_scales = _poise.reference_quantize_fp8_weight_blocks(w.float().reshape(-1).numpy(), *dims)
    bits, block_scales = torch.from_numpy(bits).view(dims), torch.from_numpy(block_scales).view(scales_shape(dims))
    if transposed:  # a block's scale does not depend on its orientation
        bits, block_scales = bits.transpose(1, 2), block_scales.transpose(1, 2)
    values.view(torch.uint8).copy_(bits.reshape(values.shape))
    scales.copy_(block_scales.reshape(scales.shape))
