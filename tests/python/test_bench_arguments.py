"""The expert-MLP benchmark rejects bad diagnostic arguments by name before touching a GPU."""
import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "expert_mlp" / "bench_expert_mlp.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_expert_mlp", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_aligned_routing_names_the_shape_it_cannot_align(bench):
    with pytest.raises(ValueError, match=r"aligned routing \(skew 0\).*T=10 E=6 K=4"):
        bench.make_routing(10, 6, 4, 0.0, None)
    with pytest.raises(ValueError, match=r"T=3 E=8 K=2"):  # 6 routed rows over 8 experts
        bench.make_routing(3, 8, 2, 0.0, None)


def test_records_name_each_routing(bench):
    assert bench.routing_name(0.0) == "aligned"
    assert bench.routing_name(1.0) == "balanced"
    assert bench.routing_name(3.0) == "peak/mean~3.0"


def test_repeats_below_one_is_rejected_by_name(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_expert_mlp.py", "--lib", "/nonexistent.so", "--out", "/dev/null",
                                      "--repeats", "0"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def bench_lib(bench):
    """The bench's glue library (run_tests.sh sets POISE_BENCH_LIB to the one it built)."""
    import os

    path = os.environ.get("POISE_BENCH_LIB")
    if path is None:
        pytest.skip("POISE_BENCH_LIB not set (scripts/run_tests.sh sets it)")
    assert pathlib.Path(path).is_file(), f"POISE_BENCH_LIB={path} does not exist"
    return bench.load_lib(path)


def test_glue_rejects_bad_top_k_and_expert_counts_before_any_cuda_call(bench_lib):
    # Null device pointers: each call must refuse before it touches one (or the CUDA runtime).
    def layout(tk, experts, top_k):
        return bench_lib.pb_routing_layout(None, None, tk, experts, None, None, None, None, top_k, None, None)

    def last_error():
        return bench_lib.pb_last_error().decode()

    for tk, top_k in ((24, 0), (24, 5), (24, -8)):
        assert layout(tk, 4, top_k) == -1
        assert last_error() == "pb_routing_layout: top_k must be positive and divide tk"
    assert layout(24, 1025, 8) == -1
    assert last_error() == "pb_routing_layout: at most 1024 experts"
    for K in (0, 65, 5):
        assert bench_lib.pb_scatter_rows(None, 24, K, 64, None, None, None) == -1
        assert last_error() == "scatter_rows: K must be in [1, 64] and divide tk"
