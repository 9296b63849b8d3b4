"""poise.Context lifecycle: create, inspect, reset, close (twice is fine), use after close raises."""

import threading

import pytest

import poise

CONFIG = poise.Config(num_local_input_tokens=256, hidden_dim=512, intermediate_dim=256, top_k=2, num_experts=8)


def test_create_exposes_config_plan_and_rank():
    context = poise.create_context(config=CONFIG, ep_size=4, rank=3)
    try:
        assert not context.closed
        assert (context.ep_size, context.rank) == (4, 3)
        assert context.config == CONFIG
        assert context.plan == poise.plan_memory(CONFIG, 4)
        assert "rank 3 of 4" in repr(context) and "open" in repr(context)
    finally:
        context.close()


def test_close_twice_is_fine_and_use_after_close_raises():
    context = poise.create_context(config=CONFIG, ep_size=1, rank=0)
    context.reset()  # allowed while open
    context.raise_if_faulted()  # nothing has run, so nothing has faulted
    context.close()
    assert context.closed
    context.close()
    assert context.closed
    assert "closed" in repr(context)
    with pytest.raises(poise.InvalidArgument) as raised:
        context.reset()
    assert raised.value.name == "context"
    with pytest.raises(poise.InvalidArgument, match="context"):
        context.raise_if_faulted()


def test_with_block_closes():
    with poise.Context(CONFIG, ep_size=2, rank=1) as context:
        assert not context.closed
    assert context.closed


def test_a_context_owns_a_copy_of_its_config():
    config = poise.Config(**{**CONFIG.__dict__})
    with poise.create_context(config=config, ep_size=1, rank=0) as context:
        config.top_k = 7  # later edits to the Python object do not reach the context
        assert context.config.top_k == CONFIG.top_k


@pytest.mark.parametrize("ep_size, rank", [(4, 4), (4, -1), (1, 1)])
def test_rank_outside_the_group_is_rejected(ep_size, rank):
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.create_context(config=CONFIG, ep_size=ep_size, rank=rank)
    assert raised.value.name == "rank"


def test_bad_arguments_are_named():
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.create_context(config=CONFIG, ep_size=2, rank=0.0)
    assert raised.value.name == "rank"
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.create_context(config=CONFIG, ep_size="2", rank=0)
    assert raised.value.name == "ep_size"
    with pytest.raises(poise.InvalidArgument) as raised:
        poise.create_context(config=poise.Config(**{**CONFIG.__dict__, "top_k": 9}), ep_size=2, rank=0)
    assert raised.value.name == "top_k"
    with pytest.raises(TypeError):
        poise.create_context(config=CONFIG.__dict__, ep_size=2, rank=0)
    with pytest.raises(TypeError):
        poise.create_context(CONFIG, 2, 0)  # keywords only: ep_size and rank are easy to swap


def test_every_rank_of_a_group_from_its_own_thread():
    # Virtual ranks are threads of one process; creation runs without the GIL so they can meet.
    ep_size = 4
    contexts, errors = [None] * ep_size, []

    def create(rank):
        try:
            contexts[rank] = poise.create_context(config=CONFIG, ep_size=ep_size, rank=rank)
        except Exception as error:  # reported below, with the rank
            errors.append((rank, error))

    threads = [threading.Thread(target=create, args=(rank,)) for rank in range(ep_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert [c.rank for c in contexts] == list(range(ep_size))
    closers = [threading.Thread(target=c.close) for c in contexts]
    for thread in closers:
        thread.start()
    for thread in closers:
        thread.join(timeout=60)
    assert all(c.closed for c in contexts)


def test_stage_timing_is_for_gpu_contexts():
    import poise

    config = poise.Config(num_local_input_tokens=16, hidden_dim=128, intermediate_dim=64, top_k=2, num_experts=4)
    with poise.create_context(config=config, device="cpu") as context:
        with pytest.raises(poise.InvalidArgument, match="stage timing"):
            context.enable_stage_timing()
        with pytest.raises(poise.InvalidArgument, match="stage timing"):
            context.stage_times()
