"""The PyTorch examples run on the CPU in seconds: train_moe.py (one process, and 2 ranks under
torchrun over gloo) and hf_model.py (a transformers model on Poise: trains, then generates)."""

import json
import re
import subprocess
import sys

import pytest
import torch


def run(command, repo_root):
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def losses(output: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+)$", output, re.MULTILINE)]


def test_train_moe_one_process(repo_root, tmp_path):
    plot = tmp_path / "routing.png"
    out = run([sys.executable, "examples/train_moe.py", "--device", "cpu", "--steps", "5", "--routing-plot", str(plot)],
              repo_root)
    assert "total device" in out  # the memory plan is printed first
    curve = losses(out)
    assert len(curve) == 5 and curve[-1] < curve[0], curve
    assert "routing: peak/mean rows per rank 1.00 before balancing" in out  # one rank
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_train_moe_in_fp8_writes_its_losses(repo_root, tmp_path):
    # The student's experts in FP8 (the CPU reference engine's semantics), the teacher in BF16: it
    # learns, its losses go to the JSON file, and they differ from the BF16 run's (the FP8 path ran).
    path = {p: tmp_path / f"{p}.json" for p in ("bf16", "fp8_block_scaled")}
    for precision, file in path.items():
        out = run([sys.executable, "examples/train_moe.py", "--device", "cpu", "--steps", "4", "--gemm-precision",
                   precision, "--losses", str(file)], repo_root)
        assert json.loads(file.read_text()) == pytest.approx(losses(out), abs=1e-5)
    bf16, fp8 = (json.loads(f.read_text()) for f in path.values())
    assert len(fp8) == 4 and fp8[-1] < fp8[0], fp8
    assert fp8 != bf16 and fp8 == pytest.approx(bf16, rel=0.05)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_train_moe_under_torchrun_two_ranks(repo_root, tmp_path):
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "examples/train_moe.py", "--device", "cpu", "--steps", "5", "--routing-plot",
               str(tmp_path / "routing.png")], repo_root)
    assert "EP=2" in out
    assert "routing: peak/mean rows per rank" in out and (tmp_path / "routing.png").exists()
    curve = losses(out)
    assert len(curve) == 5 and curve[-1] < curve[0], curve


def test_hf_model(repo_root, tmp_path):
    pytest.importorskip("transformers")
    out = run([sys.executable, "examples/hf_model.py", "--device", "cpu", "--steps", "8", "--routing-plot",
               str(tmp_path / "routing.png")], repo_root)
    assert (tmp_path / "routing.png").read_bytes()[:4] == b"\x89PNG"
    curve = losses(out)
    assert len(curve) == 8 and curve[-1] < 0.8 * curve[0], curve
    assert re.search(r"^generated: \[(\d+, ){7}\d+\]$", out, re.MULTILINE), out
    assert "poise contexts: 2" in out
