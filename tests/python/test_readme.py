"""The README's examples work as written: the C++ program is the one CI builds against an
installed Poise (tests/install/plan.cpp), and the Python program runs."""

import re
import subprocess
import sys

import pytest


def readme_block(repo_root, language: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", (repo_root / "README.md").read_text(), re.DOTALL)
    assert blocks, f"README.md has no {language} block"
    return blocks[0]


def test_cpp_program_is_the_installed_package_check(repo_root):
    installed_check = (repo_root / "tests" / "install" / "plan.cpp").read_text()
    code = "\n".join(line for line in installed_check.splitlines() if not line.startswith("//")) + "\n"
    assert readme_block(repo_root, "cpp") == code


def test_python_program_runs(repo_root, tmp_path):
    pytest.importorskip("torch")
    program = tmp_path / "readme_example.py"
    program.write_text(readme_block(repo_root, "python"))
    result = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "total device" in result.stdout
    assert "torch.Size([256, 512]) torch.Size([256, 512]) torch.bfloat16" in result.stdout
