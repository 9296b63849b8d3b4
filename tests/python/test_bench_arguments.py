"""The routed-experts benchmark's pure parts, on the CPU: arguments, the routing generator's skew,
the inputs it builds, and the shape of its JSON records."""
import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench/routed_experts/bench.py", "routed_experts_bench")


def test_defaults_are_the_four_cases_into_the_results_file(bench):
    args = bench.parse_args([])
    assert args.out == "bench/results/routed_experts_h200.json"
    assert args.shapes == ["deepseek_v3_ep8_rank", "qwen3_30b_a3b"]
    assert args.skews == [1.0, 3.0]
    assert args.blocks >= 3 and args.reps >= 5
    args = bench.parse_args(["--out", "/tmp/x.json", "--shapes", "qwen3_30b_a3b", "--skews", "3", "--blocks", "1"])
    assert (args.out, args.shapes, args.skews, args.blocks) == ("/tmp/x.json", ["qwen3_30b_a3b"], [3.0], 1)


@pytest.mark.parametrize("argv, message", [
    (["--blocks", "0"], "--blocks must be at least 1, got 0"),
    (["--reps", "-1"], "--reps must be at least 1, got -1"),
    (["--shapes", "llama"], "--shapes: unknown shape 'llama'"),
    (["--skews", "1,x"], "--skews must be comma-separated numbers"),
    (["--settle-s", "-1"], "--settle-s and --warm-ms must be >= 0"),
])
def test_bad_arguments_are_rejected_by_name(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_commit_prefers_the_argument_then_the_environment(bench, monkeypatch):
    monkeypatch.setenv("POISE_COMMIT", "abc1234")
    assert bench.commit_of("def5678") == "def5678"
    assert bench.commit_of() == "abc1234"


@pytest.mark.parametrize("T, E, K", [(4096, 32, 8), (8192, 128, 8)])
def test_routing_reaches_its_skew_with_distinct_experts_per_token(bench, T, E, K):
    for target, low, high in ((1.0, 1.0, 1.25), (3.0, 2.7, 3.3)):
        gen = torch.Generator().manual_seed(1234)
        ids_TK, skew = bench.make_routing(T, E, K, target, gen)
        assert ids_TK.shape == (T, K) and ids_TK.dtype == torch.int64 and ids_TK.device.type == "cpu"
        assert 0 <= int(ids_TK.min()) and int(ids_TK.max()) < E
        assert bool((ids_TK.sort(dim=1).values.diff(dim=1) > 0).all()), "an expert picked twice by one token"
        counts = torch.bincount(ids_TK.flatten(), minlength=E).double()
        assert skew == pytest.approx((counts.max() / counts.mean()).item())
        assert low <= skew <= high, (target, skew)
    assert bench.routing_name(1.0) == "balanced" and bench.routing_name(3.0) == "peak/mean~3"


def test_inputs_are_random_leaves_with_int32_ids_for_poise(bench):
    inputs, _ = bench.make_inputs(64, 128, 64, 8, 2, 1.0, device="cpu")
    assert [inputs[n].requires_grad for n in bench.LEAVES] == [True] * 4
    assert isinstance(inputs["w13_E2FD"], torch.nn.Parameter) and inputs["w13_E2FD"].shape == (8, 128, 128)
    assert inputs["w2_EDF"].shape == (8, 128, 64) and inputs["x_TD"].dtype == torch.bfloat16
    assert inputs["ids32_TK"].dtype == torch.int32 and torch.equal(inputs["ids32_TK"].long(), inputs["ids_TK"])
    scores = inputs["scores_TK"].detach()
    assert bool((scores > 0).all()) and torch.allclose(scores.sum(dim=1), torch.ones(64))
    for name in ("x_TD", "grad_out_TD"):
        assert inputs[name].float().std().item() == pytest.approx(1.0, rel=0.1)  # never zeros


def test_records_hold_medians_speedups_tflops_and_errors(bench):
    block_ms = {"baseline_fwd_ms": [8.0, 7.0, 9.0], "poise_fwd_ms": [4.0, 5.0, 6.0],
                "baseline_fwdbwd_ms": [20.0, 21.0, 19.0], "poise_fwdbwd_ms": [15.0, 14.0, 16.0]}
    errors = {"out": 6e-3, "grad_x": 6e-3, "grad_scores": 4e-3, "grad_w13": 5e-3, "grad_w2": 4e-3}
    rec = bench.case_record("qwen3_30b_a3b", 3.0, 3.0271, block_ms, errors)
    assert (rec["shape"], rec["routing"], rec["skew"]) == ("qwen3_30b_a3b", "peak/mean~3", 3.027)
    assert (rec["T"], rec["D"], rec["F"], rec["E_local"], rec["K"]) == (8192, 2048, 768, 128, 8)
    assert (rec["poise_fwd_ms"], rec["baseline_fwd_ms"], rec["speedup_fwd"]) == (5.0, 8.0, 1.6)
    assert (rec["poise_fwdbwd_ms"], rec["baseline_fwdbwd_ms"]) == (15.0, 20.0)
    flops = 6.0 * 8192 * 8 * 2048 * 768
    assert rec["poise_fwd_tflops"] == pytest.approx(flops / 5.0 / 1e9)
    assert rec["poise_fwdbwd_tflops"] == pytest.approx(3 * flops / 15.0 / 1e9)
    assert rec["correct"] and rec["rel_err_vs_baseline"] == errors and rec["block_ms"] == block_ms
    assert not bench.case_record("qwen3_30b_a3b", 3.0, 3.0, block_ms, {**errors, "grad_x": 0.5})["correct"]


def test_compare_takes_medians_per_label_and_ratios_to_the_first(load_script):
    compare = load_script("bench/routed_experts/compare.py", "routed_experts_compare")

    def run(label, fwd, fwdbwd):
        return {"label": label, "cases": [{"shape": "qwen3_30b_a3b", "routing": "balanced", "fwd_ms": fwd,
                                           "fwdbwd_ms": fwdbwd}]}

    runs = [run("new", 1.0, 4.0), run("old", 2.0, 6.0), run("new", 3.0, 2.0), run("old", 2.2, 5.0),
            run("new", 1.2, 3.0)]
    medians = compare.medians_by_label(runs)
    assert list(medians) == ["new", "old"]
    assert medians["new"][("qwen3_30b_a3b", "balanced")] == {"fwd_ms": 1.2, "fwdbwd_ms": 3.0, "runs": 3}
    assert medians["old"][("qwen3_30b_a3b", "balanced")] == {"fwd_ms": 2.1, "fwdbwd_ms": 5.5, "runs": 2}
    old_line = compare.table(medians).splitlines()[-1].split()
    assert old_line[0] == "old" and old_line[-2:] == ["1.750", "1.833"]
