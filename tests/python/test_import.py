"""`import poise` must not initialize CUDA: it works on machines without a GPU and costs no context.

How we know: the CUDA runtime (linked statically into the extension) loads the driver library
libcuda.so.1 on its first call. A child process gets a fake libcuda.so.1 first on its library path
that leaves a marker file when loaded. The host-only API must leave no marker; a call that does
initialize CUDA (poise.cuda_device_count) must leave one, which shows the detector works.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

FAKE_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void poise_test_mark_loaded(void) {
  const char* path = getenv("POISE_TEST_LIBCUDA_MARKER");
  FILE* f = path ? fopen(path, "w") : NULL;
  if (f) { fputs("libcuda.so.1 was loaded\n", f); fclose(f); }
}
"""

HOST_ONLY_USE = """
import poise
config = poise.Config(num_local_input_tokens=4096, hidden_dim=7168, intermediate_dim=2048, top_k=8, num_experts=256)
config.validate(8)
poise.plan_memory(config, 8).explain()
try:
    poise.Config(num_local_input_tokens=4096, hidden_dim=7168, intermediate_dim=2048, top_k=0, num_experts=256)
except poise.InvalidArgument:
    pass
"""


@pytest.fixture
def fake_libcuda(tmp_path: pathlib.Path):
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("needs a C compiler to build the fake libcuda.so.1")
    source = tmp_path / "fake_libcuda.c"
    source.write_text(FAKE_LIBCUDA)
    library_dir = tmp_path / "lib"
    library_dir.mkdir()
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library_dir / "libcuda.so.1"), str(source)], check=True)
    return library_dir


def run_with_fake_libcuda(library_dir: pathlib.Path, tmp_path: pathlib.Path, code: str) -> bool:
    marker = tmp_path / "libcuda_loaded"
    marker.unlink(missing_ok=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(library_dir), env.get("LD_LIBRARY_PATH")]))
    env["POISE_TEST_LIBCUDA_MARKER"] = str(marker)
    env["CUDA_VISIBLE_DEVICES"] = ""  # never touch a real GPU from this test
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path)
    return marker.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_LIBRARY_PATH interposition is Linux-only")
def test_import_and_host_api_do_not_touch_cuda(fake_libcuda, tmp_path):
    assert not run_with_fake_libcuda(fake_libcuda, tmp_path, "import poise")
    assert not run_with_fake_libcuda(fake_libcuda, tmp_path, HOST_ONLY_USE)
    # The control: a real CUDA call loads the driver library, so the check above could have failed.
    assert run_with_fake_libcuda(fake_libcuda, tmp_path, "import poise; poise.cuda_device_count()")


def test_import_pulls_in_no_framework():
    code = "import sys, poise; print(sorted(m for m in ('torch', 'numpy', 'jax', 'cupy') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.gpu
def test_on_a_gpu_machine_the_real_driver_loads_only_on_demand():
    code = (
        "import poise\n"
        "maps = lambda: open('/proc/self/maps').read()\n"
        "assert 'libcuda.so' not in maps(), 'import poise loaded libcuda'\n"
        "n = poise.cuda_device_count()\n"
        "assert n >= 1, n\n"
        "assert 'libcuda.so' in maps()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
