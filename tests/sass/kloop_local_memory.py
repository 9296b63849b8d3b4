#!/usr/bin/env python3
"""The grouped-GEMM kernels' K loops hold no local-memory traffic.

A K loop runs once per 64 (BF16) or 128 (FP8) elements of K for every tile; a register the consumer
warpgroups cannot keep (they run at the edge of their 240 registers) is spilled and reloaded from
local memory there every time, with the latency of an L1 miss in front of the next wgmmas: the FP8
FPROP W13 kernel reloaded seven scale offsets per K block and ran at 62% of the FP8 dense rate where
the FP8 W2 kernel, without them, ran at 83% (docs/performance.md). This reads the kernels' SASS
(cuobjdump and nvdisasm, from PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm:
requirements-dev.txt) and, for every grouped_gemm kernel, fails on any LDL / STL in its innermost
loops that issue wgmmas (QGMMA / HGMMA).

  python3 tests/sass/kloop_local_memory.py LIBRARY   (ctest: sass_kloop_local_memory, label cpu)
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys


def cuda_tool(name: str) -> str:
    """cuobjdump or nvdisasm: on PATH, or from PyPI's nvidia-cuda-* wheels (requirements-dev.txt)."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in pathlib.Path(root).glob(f"cu*/bin/{name}"):
            return str(candidate)
    sys.exit(f"{name} not found: pip install -r requirements-dev.txt (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")


def disassemble(library: str) -> str:
    """The library's SASS (cuobjdump -sass, which runs nvdisasm); members without device code are skipped."""
    env = {**os.environ, "PATH": os.path.dirname(cuda_tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", "")}
    run = subprocess.run([cuda_tool("cuobjdump"), "-sass", library], capture_output=True, text=True, env=env)
    if "Function :" not in run.stdout:
        sys.exit(f"cuobjdump -sass {library} gave no kernels (exit {run.returncode}): {run.stderr.strip()[:500]}")
    return run.stdout


def kernels(sass: str):
    """(mangled name, [(address, instruction)]) of every grouped_gemm kernel."""
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        if "grouped_gemm_kernel" in name:
            yield name, [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", block)]


def k_loops(instructions):
    """The innermost loops (a backward branch's range) that issue wgmmas: (first, last) addresses."""
    loops = set()
    for address, op in instructions:
        target = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < address:
            first = int(target.group(1), 16)
            if any("GMMA" in o for a, o in instructions if first <= a <= address):
                loops.add((first, address))
    return [(f, l) for f, l in loops if not any((f2, l2) != (f, l) and f <= f2 and l2 <= l for f2, l2 in loops)]


def main(argv) -> int:
    if len(argv) != 2:
        sys.exit(__doc__)
    sass = disassemble(argv[1])
    checked, failures = 0, []
    for name, instructions in kernels(sass):
        loops = k_loops(instructions)
        if not loops:
            failures.append(f"{name}: no K loop found (a loop issuing wgmmas)")
        for first, last in loops:
            local = [op for a, op in instructions if first <= a <= last and re.match(r"\s*(@!?U?P\w+\s+)?(LDL|STL)", op)]
            checked += 1
            if local:
                failures.append(f"{name}: K loop {first:#x}-{last:#x} has {len(local)} local-memory instructions: "
                                f"{local[:4]}")
    if checked == 0:
        failures.append(f"no grouped_gemm kernel found in {argv[1]}")
    print(f"{checked} K loops checked in {argv[1]}")
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
