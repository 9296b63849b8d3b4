"""GPU tests (@pytest.mark.gpu) run only where a CUDA device is present; CPU tests run everywhere.

The device count is asked in a child process so this test process itself never initializes CUDA.
"""

import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cuda_device_count() -> int:
    probe = subprocess.run(
        [sys.executable, "-c", "import poise; print(poise.cuda_device_count())"],
        capture_output=True, text=True, check=True,
    )
    return int(probe.stdout.strip())


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and _cuda_device_count() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def repo_root() -> pathlib.Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def load_script():
    """Imports a repository script (a benchmark, not a package module) by its path below the root."""
    import importlib.util

    def load(relative_path: str, name: str):
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / relative_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def deepseek_v3() -> "poise.Config":
    import poise

    return poise.Config(num_local_input_tokens=4096, hidden_dim=7168, intermediate_dim=2048, top_k=8, num_experts=256)


def read_struct_fields(header: pathlib.Path, struct: str) -> list[str]:
    """Data member names of `struct <struct> { ... };` in a C++ header, in declaration order."""
    text = header.read_text()
    body = text.split(f"struct {struct} {{", 1)[1].split("\n};", 1)[0]
    # A data member: `type name;` or `type name = default;` (methods have parentheses before ';').
    import re

    member = re.compile(r"^\s*(?:const\s+)?[\w:<>]+\s+(\w+)\s*(?:=[^;(]*)?;", re.MULTILINE)
    return member.findall(body)


@pytest.fixture
def cpp_fields():
    def fields(header: str, struct: str) -> list[str]:
        return read_struct_fields(REPO_ROOT / "include" / "poise" / header, struct)

    return fields
