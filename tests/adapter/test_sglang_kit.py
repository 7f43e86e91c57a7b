"""sglang's own DeepSeek-V4 attention test kit, run as shipped with ``--attention-backend dsv4``.

The kit (``sglang/test/kits/attention_unittest/attention_methods/dsv4_attention.py``) builds a
real ``DeepSeekV4TokenToKVPool``, writes the window keys with sglang's writer
(``set_swa_key_buffer_radix``: fp8 pack, then sglang's SWA page layout) and compares the
backend's output with a bf16 reference. The backend reads those bytes through its aliased
window cache, so a case passes only when its page layout is sglang's.

The window-only cases (``make_dsv4_cases``) are run; the kit's other runners
(``run_dsv4_target_verify_attention_case``, ``run_dsv4_draft_extend_attention_case``,
``run_dsv4_compress_attention_case`` and the runner-mode callbacks) read the built-in
backend's private metadata (``forward_metadata.core_metadata``), which this backend does not
have, so they are not run.

On the CPU the kit's Triton quantiser runs in the interpreter, whose fp32 -> e4m3 cast drops
the mantissa carry of round-to-nearest (31.4 becomes 16, not 32). ``gpu_fp8_casts`` makes the
interpreter round as the GPU's ``cvt.rn`` does (through torch's e4m3 cast); nothing else of
the kit is changed. Each case costs the interpreter about a second per key token, so two short
cases run by default and ``DSV4_SGLANG_KIT=all`` runs every window-only case.
"""

from __future__ import annotations

import importlib
import os
import unittest
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import torch
import triton.language as tl
from marks import needs_interpreter
from triton.runtime import interpreter

from dsv4_backend import registration
from dsv4_backend.kernels.dispatch import TORCH, force_path

pytestmark = [needs_interpreter, pytest.mark.sglang]  # the kit's Triton kernels

KIT = "sglang.test.kits.attention_unittest.attention_methods.dsv4_attention"
QUICK = ("dsv4_swa_extend_no_prefix", "dsv4_swa_decode_within_window")
# The kit pins sglang's attention parallel context when imported: only import it to run it.
SELECTED = (
    [case.name for case in importlib.import_module(KIT).make_dsv4_cases("dsv4")]
    if os.environ.get("DSV4_SGLANG_KIT") == "all"
    else list(QUICK)
)


@pytest.fixture(scope="module")
def kit() -> ModuleType:
    """The kit, with ``dsv4`` served by this package (``registration.register``)."""
    registration.register()
    return importlib.import_module(KIT)


@pytest.fixture
def gpu_fp8_casts(monkeypatch) -> Iterator[None]:
    """fp32 -> e4m3fn casts of the Triton interpreter rounded to nearest even (as on a GPU)."""
    cast = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(src.data))
            codes = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(codes, dst_type.scalar)
        return cast(self, src, dst_type, rounding_mode)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
    yield


def _kit_codes_are_torchs(kit: ModuleType) -> bool:
    """Whether the kit's quantiser gives torch's e4m3 codes of the keys over their scales."""
    k = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    pack = kit.quant_to_nope_fp8_rope_bf16_pack_triton(k)
    scale = torch.exp2(pack.scale_k_nope_ue8m0.float() - 127).repeat_interleave(64, dim=1)
    exact = (k[:, :448].float() / scale).to(torch.float8_e4m3fn)
    return torch.equal(pack.k_nope_fp8.view(torch.uint8), exact.view(torch.uint8))


def test_the_interpreter_misrounds_without_the_fix(kit) -> None:
    assert not _kit_codes_are_torchs(kit)


def test_the_fixed_cast_rounds_as_torch(kit, gpu_fp8_casts) -> None:
    assert _kit_codes_are_torchs(kit)


@pytest.mark.parametrize("name", SELECTED)
def test_window_only_case(name: str, kit, gpu_fp8_casts) -> None:
    cases = {case.name: case for case in kit.make_dsv4_cases("dsv4")}
    # The backend's own ops on their torch path: the interpreter's time goes to the kit.
    with force_path(TORCH):
        kit.run_dsv4_attention_case(unittest.TestCase(), cases[name], device="cpu")
