"""bench/transformers/bench.py on the CPU at tiny dims: its arguments, and one whole run's JSON
(the figures themselves come from the H200: scripts/device_session.sh python transformers)."""
import json
import math

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench/transformers/bench.py", "transformers_bench")


def test_defaults_are_the_issue_s_case(bench):
    args = bench.parse_args([])
    assert (args.layers, args.batch, args.seq, args.decode_steps) == (2, 8, 1024, 64)
    assert args.implementations == ["poise", "grouped_mm", "eager"]
    assert args.out == "bench/results/transformers_h200.json"


def test_gpt_oss_family_writes_its_own_file(bench):
    args = bench.parse_args(["--family", "gpt_oss"])
    assert args.family == "gpt_oss" and args.out == "bench/results/transformers_gpt_oss_h200.json"


@pytest.mark.parametrize("argv", [["--implementations", "fast"], ["--decode-steps", "1"], ["--batch", "0"]])
def test_bad_arguments_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_tiny_run_writes_every_figure(bench, tmp_path):
    out = tmp_path / "transformers.json"
    argv = ["--tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--decode-steps", "2", "--reps", "1",
            "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["results"]
    assert set(rows) == {"poise", "grouped_mm", "eager", "zero (the rest of the model)"}
    for name in ("poise", "grouped_mm", "eager"):
        # A decode step is a difference of two timings (generate - prefill): at tiny dims on a busy
        # CPU it may come out negative, so only its presence is checked.
        assert rows[name]["train_step_ms"] > 0 and math.isfinite(rows[name]["decode_step_ms"])
        assert set(rows[name]["moe_speedup_vs_grouped_mm"]) == {"train_moe_ms", "prefill_moe_ms", "decode_moe_step_ms"}
        assert len(rows[name]["decode_step_ms_reps"]) == len(rows[name]["decode_moe_step_ms_reps"]) == 1
        spread = rows[name]["decode_step_speedup_vs_grouped_mm_reps"]
        assert spread["min"] <= spread["median"] <= spread["max"]
    assert result["model"]["tiny"] and result["model"]["num_hidden_layers"] == 2


def test_decode_trace_tiny_run_times_every_moe_call(load_script, tmp_path):
    """bench/transformers/decode_trace.py: every decode step's MoE calls (one per layer) timed."""
    trace = load_script("bench/transformers/decode_trace.py", "transformers_decode_trace")
    out = tmp_path / "trace.json"
    assert trace.main(["--tiny", "--device", "cpu", "--decode-steps", "3", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"poise", "grouped_mm", "zero"}
    for row in rows.values():
        assert row["moe_calls_per_step"] == 2 and row["moe_call_host_us_median"] > 0
        assert len(row["decode_step_ms_reps"]) == 1
