"""The benchmark's clock sampler: nvidia-smi's lines read by time window, and a missing nvidia-smi
reported instead of raised (CPU machines have none)."""
import datetime

import pytest


@pytest.fixture(scope="module")
def smi(load_script):
    return load_script("bench/smi_sampler.py", "smi_sampler")


def stamp(t):
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_samples_are_taken_by_window_and_bad_lines_skipped(smi):
    t0 = 1_800_000_000.0
    lines = [f"{stamp(t0 + 0.05 * i)}, {1500 + 10 * i}, {600.5 + i}, 0x0000000000000004\n" for i in range(20)]
    lines += ["garbage\n", f"{stamp(t0 + 0.5)}, [N/A], 700, 0x0\n", "\n"]
    got = smi.samples_between(lines, t0 + 0.2, t0 + 0.4, skip_s=0.0)
    assert [s[0] for s in got] == [1540.0, 1550.0, 1560.0, 1570.0, 1580.0]
    assert got[0][1] == pytest.approx(604.5) and got[0][2] == "0x0000000000000004"
    # skip_s drops the window's start (a workload's ramp)
    assert [s[0] for s in smi.samples_between(lines, t0 + 0.2, t0 + 0.4, skip_s=0.1)] == [1560.0, 1570.0, 1580.0]
    mhz, watts, reasons, n = smi.median_clock_power(got)
    assert (mhz, n, reasons) == (1560.0, 5, ["0x0000000000000004"])
    assert watts == pytest.approx(606.5)
    assert smi.median_clock_power([]) is None


def test_without_nvidia_smi_nothing_is_sampled_and_identity_says_why(smi, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    identity = smi.device_identity()
    assert set(identity) == {"error"} and identity["error"].startswith("nvidia-smi:")
    with smi.SmiSampler(period_ms=10) as sampler:
        pass
    assert sampler.samples_between(0.0, 4e9) == []


def test_block_clocks_are_medians_per_repeat_with_none_for_empty_windows(smi, load_script):
    bench = load_script("bench/routed_experts/bench.py", "routed_experts_bench")
    t0 = 1_800_000_000.0
    sampler = smi.SmiSampler()
    sampler.lines = [f"{stamp(t0 + 0.1 * i)}, {1400 + i}, {500 + i}, 0x0\n" for i in range(10)]
    got = bench.block_clocks(sampler, {"fwdbwd_ms": [(t0, t0 + 0.25), (t0 + 5, t0 + 6)]})
    assert got["block_sm_mhz"] == {"fwdbwd_ms": [1401.0, None]}
    assert got["block_power_w"] == {"fwdbwd_ms": [501.0, None]}
    assert got["block_clock_samples"] == {"fwdbwd_ms": [3, 0]}
    assert got["block_clock_reasons"] == {"fwdbwd_ms": ["0x0"]}
