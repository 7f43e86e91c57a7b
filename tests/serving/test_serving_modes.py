"""Every serving mode through the planner, the caches and the kernels equals one full causal
pass (docs/design.md §2, "The invariant").

The tiny configuration of section 6 (layers of ratio 0, 4, 128, 4); requests scattered over the
page pool, window slots behind a random ``full_to_swa``. Most schedules run the torch path (fast);
``test_every_kernel_in_the_interpreter`` runs the same modes through every Triton kernel.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.attention.common import force_num_splits
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.kernels.variants import force_unverified
from dsv4_backend.planning import BatchView
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel
from dsv4_backend.tools.gpu_verdict import judge_serving_modes

pytestmark = pytest.mark.usefixtures("torch_path")

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
#: fp32 caches: kernels and reference differ only by summation order.
ATOL = 2e-5


def make_model(max_lens: list[int], seed: int = 0, fmt: str = "dense") -> RandomModel:
    generator = torch.Generator().manual_seed(seed)
    pool = PagedRequestPool(CONFIG, max_lens, generator=generator)
    return RandomModel(CONFIG, pool, generator=generator, fmt=fmt)


def check(model: RandomModel, batch: BatchView, atol: float = ATOL, **kwargs: object) -> None:
    result = model.forward(batch, **kwargs)
    assert result.outputs, "the forward ran no layer"
    error = model.max_error(result)
    assert error <= atol, f"{batch.kind.name}: max error {error:.3g} > {atol}"


def test_chunked_extend_matches_full_pass() -> None:
    """Prefix + new: 3+1, 126+4, 250+10, 130+200, in two batched extends."""
    model = make_model([4, 130, 260, 330])
    pool = model.pool
    check(model, pool.extend([0, 1, 2, 3], [0, 0, 0, 0], [3, 126, 250, 130]))
    check(model, pool.extend([0, 1, 2, 3], [3, 126, 250, 130], [1, 4, 10, 200]))


def test_decode_across_window_block_and_page_boundaries() -> None:
    """Decode 124 -> 132, 252 -> 260 and 508 -> 516 in one batch."""
    model = make_model([132, 260, 516])
    pool = model.pool
    lens = [124, 252, 508]
    check(model, pool.extend([0, 1, 2], [0, 0, 0], lens))
    for _ in range(8):
        lens = [n + 1 for n in lens]
        check(model, pool.decode([0, 1, 2], lens))


def test_verify_draft_steps_and_draft_extend() -> None:
    """Verify 4 drafts at 126 and 253, a 3-step draft after it, the MTP draft extend, decode."""
    model = make_model([140, 270])
    pool = model.pool
    check(model, pool.extend([0, 1], [0, 0], [126, 253]))
    check(model, pool.verify([0, 1], [126, 253], 4))
    for step in range(3):
        check(model, pool.draft_step([0, 1], [130, 257], 3, step))
    # The draft model's extend is window only: it serves the ratio-0 layers.
    result = model.forward(pool.extend([0, 1], [130, 257], [3, 3], draft_model=True))
    assert result.layers == [0] and result.metadata.c4 is None
    assert model.max_error(result) <= ATOL
    check(model, pool.decode([0, 1], [134, 261]))


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_rejected_drafts_leave_no_trace(accepted: int) -> None:
    """Verify with wrong drafts after ``accepted`` tokens; the next forwards still match.

    Rejected rows wrote window keys, compressor rings and compressed entries; the following
    verify rewrites those positions with the right tokens and must not see the stale state.
    """
    model = make_model([150, 270])
    pool = model.pool
    check(model, pool.extend([0, 1], [0, 0], [125, 252]))
    # The bonus token (row 0) is always right; drafts after ``accepted`` more are wrong.
    first_wrong = {0: 125 + 1 + accepted, 1: 252 + 1 + accepted}
    check(model, pool.verify([0, 1], [125, 252], 5), rejected=first_wrong)
    committed = [first_wrong[0], first_wrong[1]]
    check(model, pool.verify([0, 1], committed, 5))
    check(model, pool.decode([0, 1], [n + 6 for n in committed]))


def test_idle_batch_plans_no_rows() -> None:
    model = make_model([8])
    result = model.forward(model.pool.idle())
    assert result.metadata.num_rows == 0 and result.rows == []


def test_fp8_caches_within_quantisation_error() -> None:
    """The same modes with FP8 caches: close to the reference, not equal to it.

    e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per key element), so window-only
    outputs move by a few percent; on c4 layers a quantised indexer key can also swap an entry
    at the top-k boundary, which moves single rows further, so those are bounded on average.
    """
    model = make_model([140, 262], fmt="fp8")
    pool = model.pool
    for batch in (
        pool.extend([0, 1], [0, 0], [126, 253]),
        pool.verify([0, 1], [126, 253], 4),
        pool.decode([0, 1], [131, 258]),
    ):
        result = model.forward(batch)
        for layer, out in zip(result.layers, result.outputs, strict=True):
            expected = model.expected(layer, result.rows)
            error = (out - expected).abs()
            relative = error.mean() / expected.abs().mean()
            assert 1e-4 < relative < 0.1, (batch.kind.name, layer, relative)
            if CONFIG.compress_ratios[layer] == 0:
                assert error.max() < 0.15, (batch.kind.name, layer, error.max())


@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "split-merge"])
def test_every_kernel_in_the_interpreter(splits: int) -> None:
    """Extend, verify, draft steps and decode through every Triton kernel (interpreter), the
    attention with one key split and with three (the split-merge path a GPU takes for small
    batches)."""
    model = make_model([136, 12])
    pool = model.pool
    check(model, pool.extend([0, 1], [0, 0], [126, 5]))
    with force_path("triton-interpreter"), force_num_splits(splits):
        check(model, pool.extend([0, 1], [126, 5], [1, 2]))
        check(model, pool.verify([0, 1], [127, 7], 2))
        for step in range(2):
            check(model, pool.draft_step([0, 1], [129, 9], 2, step))
        check(model, pool.decode([0, 1], [131, 11]))


@pytest.mark.gpu
@pytest.mark.parametrize("new", [False, True], ids=["default-kernels", "unverified-kernels"])
@pytest.mark.parametrize("fmt", ["fp8", "dense"])
def test_compiled_kernels_on_cuda(new: bool, fmt: str) -> None:
    """Every mode with the compiled Triton kernels (GPU machines; ``scripts/gpu_check.sh`` runs
    the same verdict in its steps), the CUDA defaults and (``unverified-kernels``) the ones not
    yet the default (``kernels.variants.force_unverified``), fp8 caches with bf16 queries as a
    deployment runs them, and dense fp32 caches.

    Judged step by step against the torch path (``tools/gpu_verdict.py``): the indexer's
    bf16 dots may swap a near tie at the top-k boundary, which is not an attention error.
    """
    query_dtype = torch.bfloat16 if fmt == "fp8" else None
    with force_unverified(new):
        judge = judge_serving_modes("cuda", "triton", fmt=fmt, query_dtype=query_dtype)
    assert judge.passed, [f for f in judge.findings if not f.passed]
