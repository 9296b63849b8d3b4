"""examples/plan_memory.py runs without a GPU and prints a plan per model."""

import subprocess
import sys


def test_plan_memory_example(repo_root):
    result = subprocess.run(
        [sys.executable, str(repo_root / "examples" / "plan_memory.py")], capture_output=True, text=True, check=True
    )
    out = result.stdout
    assert "DeepSeek-V3, EP8" in out and "Qwen3-30B-A3B" in out
    assert "EP=8, T=4096, D=7168, F=2048, E=256" in out
    assert "T=8192, D=2048, F=768, E=128" in out
    assert out.count("total device") >= 2
