"""The Triton kernels compiled ahead of time on the CPU for sm_90a (H200): sparse attention,
its merge and key-union kernels and the planner's kernels (``test_nothing_spills`` covers
all); and the attention kernels for sm_100a (B200: tcgen05 dots).

``benchmarks/sass_report.py`` (on ``dsv4_backend.tools.aot_compile``) compiles the launch
configurations the backend makes at DeepSeek-V4-Flash shapes (H = 64, D = 512; window-only, c4
and c128 layers; dense bf16 and fp8 caches; one split and several; the merge kernel; the c4
layer at 16 and 32 heads a rank; :data:`QUICK`, every one under ``DSV4_STRESS=1``) with
Triton's backend for the target and its bundled ptxas, and reads the main loop from the SASS.
No GPU is needed; a GPU machine runs the same check. The compiles run in one subprocess: the test
session's ``TRITON_INTERPRET=1`` would turn the kernels into interpreted ones.
"""

from __future__ import annotations

import pytest
from aot_reports import SASS_REPORT, compiled_reports
from stress import STRESS

from dsv4_backend.kernels.attention import triton as sa

pytestmark = pytest.mark.compiled


def _report(*args: str) -> dict[str, dict[str, dict]]:
    """``sass_report.py --json ARGS`` by target, then by configuration name."""
    out: dict[str, dict[str, dict]] = {}
    for r in compiled_reports([*SASS_REPORT, *args], timeout=1200):
        out.setdefault(r["target"], {})[r["name"]] = r
    return out


#: The attention launches compiled for sm_90a, dense and fp8 (64 heads: window-only finalising,
#: c4 with key splits; 16 heads one row a program; a verify request's rows at 32 heads on a
#: c128 layer), and the planner's kernels at a small uniform batch (checks) and a large extend
#: (fields): each kind once, as a cold compile costs 2-3 s of CPU a kernel. ``DSV4_STRESS=1``
#: compiles every configuration (20 attention launches, 8 planner kernels), as
#: ``benchmarks/sass_report.py`` does. The indexer and compressor kernels are
#: ``test_indexer_compressor_sass.py``'s.
QUICK = ("-r0-s1", "-r4-s8", "-r4-s4-h16", "-r128-s4-g-h32")
QUICK_PLAN = ("checks-uniform-b8", "fields-extend-b256")
#: Of those, the launches compiled for sm_100a (64 M lines a program: the tcgen05 dots): each
#: key format once, fp8 on a c4 layer with key splits, dense for a verify request's rows on a
#: c128 layer at 32 heads; ``DSV4_STRESS=1`` compiles both formats of window-only, c4 with
#: splits, one row at 16 heads and verify requests at 16 and 32 heads.
BLACKWELL_KINDS = ("-r0-s1", "-r4-s8", "-r4-s4-h16", "-r4-s1-g-h16", "-r128-s4-g-h32")
BLACKWELL = (
    tuple(f"attention-{fmt}{kind}" for fmt in ("dense", "fp8") for kind in BLACKWELL_KINDS)
    if STRESS
    else ("attention-fp8-r4-s8", "attention-dense-r128-s4-g-h32")
)


def _attention_names(kinds: tuple[str, ...]) -> list[str]:
    return [f"attention-{fmt}{kind}" for fmt in ("dense", "fp8") for kind in kinds]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, dict]]:
    """Both targets' configurations, compiled in one process (one import of torch and Triton)."""
    if STRESS:
        hopper = ["attention-", "merge-", "key-union-", "plan-"]
    else:
        plan = [f"plan-{k}" for k in QUICK_PLAN]
        hopper = [*_attention_names(QUICK), "merge-", "key-union-", *plan]
    return _report(
        "--target", "sm_90a", "--target", "sm_100a",
        *(f"sm_90a:{n}" for n in hopper), *(f"sm_100a:{n}" for n in BLACKWELL),
    )  # fmt: skip


@pytest.fixture(scope="module")
def reports(compiled: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """The attention, merge, key-union and planner configurations on sm_90a."""
    return compiled["sm_90a"]


@pytest.fixture(scope="module")
def blackwell(compiled: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """The :data:`BLACKWELL` attention configurations on sm_100a."""
    return compiled["sm_100a"]


def test_every_configuration_compiled(reports: dict[str, dict]) -> None:
    names = set(reports)
    for fmt in ("dense", "fp8"):
        for layer in ("r0", "r4", "r128"):
            assert any(n.startswith(f"attention-{fmt}-{layer}-") for n in names), (fmt, layer)
    assert any(n.endswith("-s1") for n in names) and any(not n.endswith("-s1") for n in names)
    assert any(n.startswith("merge-") for n in names)
    assert any("-g-" in n for n in names) and "key-union-g4" in names


def _one_row_at_tp(name: str) -> bool:
    """An attention launch of one row a program with fewer than 64 heads (``-h`` without
    ``-g-``)."""
    return "-h" in name and "-g-" not in name


def test_attention_dots_are_bf16_wgmma(reports: dict[str, dict]) -> None:
    """Both dots (q k^T and p v) on Hopper tensor cores with bf16 operands and fp32
    accumulation: wgmma ``.f32.bf16.bf16``; no tf32 and no pre-Hopper ``mma.sync``. Also at
    16 and 32 heads a rank when a program takes the rows of a verify request together
    (``-g-``: 64 M lines)."""
    for name, report in reports.items():
        if not name.startswith("attention-") or _one_row_at_tp(name):
            continue
        mma = report["mma"]
        assert mma, f"{name}: no tensor-core instruction"
        for op in mma:
            assert op.startswith("wgmma.mma_async") and op.endswith(".f32.bf16.bf16"), (name, op)
        # the [64, 512] accumulator: one m64n256 per warpgroup, both warpgroups busy
        assert any(".m64n256k16." in op for op in mma), (name, mma)


def test_attention_tp_dots_are_bf16(reports: dict[str, dict]) -> None:
    """16 and 32 heads a rank, one row a program (decode): the M side is below the 64 rows of a
    warpgroup's wgmma, so Triton emits ``mma.sync`` -- still bf16 operands with fp32
    accumulation, never tf32."""
    tp = [name for name in reports if name.startswith("attention-") and _one_row_at_tp(name)]
    assert {n.rsplit("-", 1)[1] for n in tp} == ({"h16", "h32"} if STRESS else {"h16"}), tp
    for name in tp:
        mma = reports[name]["mma"]
        assert mma, f"{name}: no tensor-core instruction"
        for op in mma:
            assert op.endswith(".f32.bf16.bf16.f32") or op.endswith(".f32.bf16.bf16"), (name, op)


def test_nothing_spills(reports: dict[str, dict]) -> None:
    """ptxas -v: no spill stores/loads and no stack frame, every configuration; shared memory
    within one H200 SM's 227 KiB."""
    for name, report in reports.items():
        assert report["spill_stores"] == report["spill_loads"] == 0, (name, report)
        assert report["stack"] == 0, (name, report)
        assert report["registers"] <= 255, (name, report)
        assert report["shared"] <= 227 * 1024, (name, report)


def test_dense_key_gather_is_pipelined(reports: dict[str, dict]) -> None:
    """Dense keys stream through cp.async stages (bf16 rows go to shared memory untouched);
    fp8 keys are dequantised in registers, which Triton does not pipeline."""
    for name, report in reports.items():
        if name.startswith("attention-dense-"):
            assert report["cp_async"] > 0, (name, report)


# ------------------------------------------------------------------------------ planner
def test_plan_kernels_compiled(reports: dict[str, dict]) -> None:
    names = {n for n in reports if n.startswith("plan-")}
    assert {f"plan-{k}" for k in QUICK_PLAN} <= names, names
    assert len(names) == (8 if STRESS else len(QUICK_PLAN)), names


# -------------------------------------------------------- the SASS report, Hopper and Blackwell
def test_attention_compiles_for_blackwell(reports, blackwell) -> None:
    """The attention launches of :data:`BLACKWELL` for sm_100a; registers and shared memory
    within a B200 SM (spills: see ``test_claimed_criteria_hold``)."""
    assert set(blackwell) == set(BLACKWELL) <= set(reports)
    for name, report in blackwell.items():
        assert report["registers"] <= 255 and report["shared"] <= 227 * 1024, (name, report)


def test_blackwell_dots_are_tcgen05_with_bf16_operands(blackwell) -> None:
    """64 M lines a program (64 heads, or a verify request's rows): tcgen05.mma kind::f16 with
    bf16 operands, the p v dot at N = 256 (the descriptor's decoded shape)."""
    for name, report in blackwell.items():
        if _one_row_at_tp(name):
            continue
        assert report["mma"] == ["tcgen05.mma.cta_group::1.kind::f16"], (name, report["mma"])
        assert "m64n256k16.bf16" in report["mma_shapes"], (name, report["mma_shapes"])
        assert all(s.endswith(".bf16") for s in report["mma_shapes"]), name


def _attention(reports: dict[str, dict], blackwell: dict[str, dict]):
    """``(name, target, report)`` of every attention configuration on both targets."""
    for target, by_name in (("sm_90a", reports), ("sm_100a", blackwell)):
        for name, report in by_name.items():
            if name.startswith("attention-"):
                yield name, target, report


def test_main_loop_is_the_key_loop(reports, blackwell) -> None:
    """The loop the figures come from holds both dots and takes the launcher's key block; its
    HBM share is one key's bytes over one SM's share of the bandwidth (fp8 584 B, dense
    1 KiB; H200 4.8 TB/s / 132 SMs, B200 8 TB/s / 148 SMs)."""
    shares = {("sm_90a", True): 16.06, ("sm_90a", False): 28.16,
              ("sm_100a", True): 10.8, ("sm_100a", False): 18.94}  # fmt: skip
    for name, target, report in _attention(reports, blackwell):
        loop = report["main_loop"]
        assert loop and loop["mma_ops"], (name, target)
        fp8 = name.startswith("attention-fp8-")
        block_m = int(name.rsplit("-h", 1)[1]) if _one_row_at_tp(name) else 64
        assert loop["keys"] == sa._launch_config(512, fp8, block_m)[0], (name, target)
        assert loop["hbm_ns_per_key"] == pytest.approx(shares[target, fp8], abs=0.01), name
        assert 0 < loop["instructions"] <= loop["body"], (name, target)


def test_claimed_criteria_hold(reports, blackwell) -> None:
    """Each kernel meets what ``roofline.SPECS`` claims for it (today's Triton kernel: no spills
    on sm_90a; dense keys gathered asynchronously, within their HBM share of issue time on
    sm_90a); the other criteria are figures."""
    claimed = 0
    for name, target, report in _attention(reports, blackwell):
        for criterion in report["claims"]:
            claimed += 1
            assert report["criteria"][criterion], (name, target, criterion, report)
    assert claimed > 0


def test_fp8_gather_is_vectorised_and_rebiased(reports, blackwell) -> None:
    """fp8 keys: no 2-byte global load in the key loop (the rope part loads 8 channels to a
    16-byte access), and the e4m3 codes become bf16 by exponent rebias, not by the hardware's
    e4m3 -> f16 unpack and an f16 -> f32 step."""
    for name, target, report in _attention(reports, blackwell):
        if not name.startswith("attention-fp8-"):
            continue
        loop = report["main_loop"]
        narrow = [op for op in loop["global_loads"] if ".U16" in op or ".S16" in op]
        assert not narrow, (name, target, loop["global_loads"])
        unpack = [op for op in loop["conversions"] if "E4M3" in op or op == "HADD2.F32"]
        assert not unpack, (name, target, loop["conversions"])
