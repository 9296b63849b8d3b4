"""poise.prepare_weights (FP8 block-scaled expert weights) on the CPU: the recipe's blocks and scales,
in-place refills through out=, named errors. tests/python/test_torch_gpu.py compares the GPU's bits."""

import pytest
import torch

import poise

E, F, D = 3, 192, 320  # F and D multiples of 64 but not of 128: last blocks of 64


def weights(seed=0):
    generator = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * F, D, generator=generator) * D**-0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=generator) * F**-0.5).bfloat16()
    return w13, w2


def dequantized(values, scales):
    blocks = scales.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    return values.float() * blocks[:, :values.shape[1], :values.shape[2]]


def test_blocks_scales_and_values_follow_the_recipe():
    w13, w2 = weights()
    w13[0, :128, :128] = 0  # an all-zero block: scale 1, values 0
    prepared = poise.prepare_weights(w13, w2)
    assert prepared.format == "fp8_e4m3"
    assert prepared.w13.dtype == torch.float8_e4m3fn and prepared.w13.shape == w13.shape
    assert prepared.w13_scales.shape == (E, 3, 3) and prepared.w2_scales.shape == (E, 3, 2)
    for w, values, scales in ((w13, prepared.w13, prepared.w13_scales), (w2, prepared.w2, prepared.w2_scales)):
        amax = torch.nn.functional.max_pool2d(w.float().abs().unsqueeze(1), 128, ceil_mode=True).squeeze(1)
        assert torch.equal(scales, torch.where(amax == 0, torch.ones_like(amax), amax / 448))
        back = dequantized(values, scales)
        assert ((back - w.float()).norm() / w.float().norm()).item() < 0.05  # 3 mantissa bits
    assert prepared.w13_scales[0, 0, 0].item() == 1.0 and not prepared.w13[0, :128, :128].float().any()


def test_out_refills_in_place():
    w13, w2 = weights(1)
    prepared = poise.prepare_weights(w13, w2)
    pointers = [t.data_ptr() for t in (prepared.w13, prepared.w13_scales, prepared.w2, prepared.w2_scales)]
    w13_new, w2_new = weights(2)
    again = poise.prepare_weights(w13_new, w2_new, out=prepared)
    assert again is prepared
    assert [t.data_ptr() for t in (again.w13, again.w13_scales, again.w2, again.w2_scales)] == pointers
    fresh = poise.prepare_weights(w13_new, w2_new)
    assert torch.equal(again.w13.view(torch.uint8), fresh.w13.view(torch.uint8))
    assert torch.equal(again.w2_scales, fresh.w2_scales)


def test_transposed_copies_are_the_blocks_transposed():
    """transposed=True: each expert's matrix's blocks transposed (a block's scale does not depend on
    its orientation), w13 from its [E, 2, F, D] view too; out= refills them, and asks for the same
    transposed."""
    w13, w2 = weights(3)
    plain = poise.prepare_weights(w13, w2)
    as_gate_up = lambda w: w.view(w.shape[0], 2, -1, w.shape[2])  # noqa: E731  [E, 2, F, D]
    both = poise.prepare_weights(as_gate_up(w13), w2, transposed=True)
    assert not plain.transposed and plain.w13_t is None and both.transposed
    for name in ("w13", "w2"):
        values, scales = getattr(plain, name), getattr(plain, f"{name}_scales")
        values_t, scales_t = getattr(both, f"{name}_t"), getattr(both, f"{name}_t_scales")
        flat = values.view(torch.uint8).reshape(values.shape[0], -1, values.shape[-1])
        assert torch.equal(values_t.view(torch.uint8), flat.transpose(1, 2))
        assert torch.equal(scales_t, scales.transpose(1, 2))
    pointers = [t.data_ptr() for t in (both.w13_t, both.w13_t_scales, both.w2_t, both.w2_t_scales)]
    w13_new, w2_new = weights(4)
    again = poise.prepare_weights(as_gate_up(w13_new), w2_new, transposed=True, out=both)
    assert [t.data_ptr() for t in (again.w13_t, again.w13_t_scales, again.w2_t, again.w2_t_scales)] == pointers
    fresh = poise.prepare_weights(w13_new, w2_new, transposed=True)
    assert torch.equal(again.w13_t.view(torch.uint8), fresh.w13_t.view(torch.uint8))
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.prepare_weights(as_gate_up(w13), w2, out=both)  # holds transposed copies: refilled with transposed=True
    assert raised.value.name == "out"
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.prepare_weights(w13, w2, transposed=1)
    assert raised.value.name == "transposed"


def test_errors_name_the_argument():
    w13, w2 = weights()

    def name_of(call):
        with pytest.raises(poise.InvalidArgument) as raised:
            call()
        return raised.value.name

    assert name_of(lambda: poise.prepare_weights(w13, w2, format="fp4")) == "format"
    assert name_of(lambda: poise.prepare_weights(w13.float(), w2)) == "w13"
    assert name_of(lambda: poise.prepare_weights(w13, w2[:, :, :100].contiguous())) == "w2"
    assert name_of(lambda: poise.prepare_weights(w13, w2[:2].contiguous())) == "w2"
    assert name_of(lambda: poise.prepare_weights(w13.transpose(1, 2), w2)) == "w13"
    other = poise.prepare_weights(w13[:2].contiguous(), w2[:2].contiguous())
    assert name_of(lambda: poise.prepare_weights(w13, w2, out=other)) == "out"
