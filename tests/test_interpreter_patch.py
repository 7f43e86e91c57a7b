"""``testing/interpreter.py``: a device call inside a launch skips Triton's language re-patch,
the launch's own patch is still made and undone, and results do not change."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from dsv4_backend.kernels.dispatch import interpreter_enabled
from dsv4_backend.testing import interpreter as fast

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _loop_kernel(x_ptr, out_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offs)
    for _ in range(STEPS):
        acc = _twice(acc) - acc  # a device call a step
    tl.store(out_ptr + offs, acc + tl.program_id(0))


def test_one_patch_a_launch_and_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def counted(fn):
        calls.append(fn)
        return original(fn)

    original = fast._original_patch_lang
    monkeypatch.setattr(fast, "_original_patch_lang", counted)
    monkeypatch.setattr(interpreter, "_patch_lang", fast._patch_lang)
    load = tl.load
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    _loop_kernel[(3,)](x, out, STEPS=5, BLOCK=8)
    assert torch.equal(out, x + 2)  # the last program's id
    assert len(calls) == 1, f"{len(calls)} language patches for one launch, expected 1"
    assert tl.load is load and not fast._patched  # the launch's patch was undone

    monkeypatch.setattr(interpreter, "_patch_lang", original)  # Triton's own: a patch a call
    plain = torch.empty(8)
    _loop_kernel[(3,)](x, plain, STEPS=5, BLOCK=8)
    assert torch.equal(plain, out)
