"""``import vmapens`` resolves MKL's vector math before an op runs it on several threads
(``vmapens/_mkl.py``, torch's issue 188792).

The race itself shows in a few fresh processes of a hundred and cannot be forced; what is
tested is what the fix rests on: that every function torch sends to MKL's vector math is called
once, on one element, in both dtypes, when vmapens is imported. The list of functions comes
from torch's own header, not from vmapens.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vmapens._mkl import VML_OPS


def _header_ops() -> set[str]:
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    if not header.exists():
        pytest.skip(f"torch ships no {header} here to read the list from")
    ops = set()
    for line in header.read_text().splitlines():
        # IMPLEMENT_VML_MKL(torch's name, MKL's name); the lines commented out do not match
        found = re.match(r"\s*IMPLEMENT_VML_MKL\((\w+),\s*(\w+)\)", line)
        if found:
            ops.add(found.group(1))
    return ops


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_the_warmed_functions_are_those_torch_sends_to_mkl() -> None:
    ops = _header_ops()
    assert ops, "no IMPLEMENT_VML_MKL line found in torch's vml.h"
    assert set(VML_OPS) == ops
    assert all(callable(getattr(torch, name)) for name in ops)


_SPY = """
import torch
from torch.overrides import TorchFunctionMode

seen = set()

class Spy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor):
            seen.add((getattr(func, "__name__", ""), str(args[0].dtype), args[0].numel()))
        return func(*args, **(kwargs or {}))

with Spy():
    import vmapens
for item in sorted(seen):
    print(*item)
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_import_calls_each_function_once_on_one_element_in_both_dtypes() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SPY], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    seen = {tuple(line.split()) for line in out.splitlines()}
    for name in _header_ops():
        for dtype in ("torch.float32", "torch.float64"):
            assert (name, dtype, "1") in seen, (name, dtype)
