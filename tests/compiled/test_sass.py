"""The SASS loop reader (dsv4_backend/tools/sass.py) on small hand-written listings."""

from __future__ import annotations

import pytest

from dsv4_backend.tools import sass

# A key loop at 0x30 with a branch diamond (0x50-0x70 or 0x80), an MMA, and an out-of-line
# mbarrier wait (0xf0, past the EXIT) that spins on itself and branches back into the body.
LISTING = """
	code for sm_90a
		Function : kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;            /* 0x0 */
        /*0010*/                   ISETP.GE.AND P0, PT, R2, R3, PT ; /* 0x0 */
        /*0020*/               @P0 BRA 0xe0 ;                        /* 0x0 */
        /*0030*/                   LDGSTS.E.BYPASS.128 [R4], desc[UR4][R6.64] ;
        /*0040*/               @P1 BRA 0x80 ;
        /*0050*/                   FADD R1, R1, R2 ;
        /*0060*/                   FADD R1, R1, R2 ;
        /*0070*/                   BRA 0x90 ;
        /*0080*/                   FMUL R1, R1, R2 ;
        /*0090*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*00a0*/              @!P2 BRA 0xf0 ;
        /*00b0*/                   IADD3 R2, R2, 0x1, RZ ;
        /*00c0*/                   ISETP.LT.AND P0, PT, R2, R3, PT ;
        /*00d0*/               @P0 BRA 0x30 ;
        /*00e0*/                   EXIT ;
        /*00f0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4], R5 ;
        /*0100*/              @!P2 BRA 0xf0 ;
        /*0110*/                   BRA 0xb0 ;
"""


def test_natural_loops_take_out_of_line_waits_and_count_the_longest_path() -> None:
    loops = sass.ControlFlow(sass.parse(LISTING)).loops()
    assert [hex(loop.header) for loop in loops] == ["0x30", "0xf0"]
    key_loop = sass.main_loop(LISTING)
    assert key_loop is not None and key_loop.header == 0x30
    assert key_loop.inner == (0xF0,)
    assert len(key_loop.instructions) == 14  # every block, the wait stub included
    # 0x30 (2) -> 0x50 (3, the longer side of the diamond) -> 0x90 (2) -> wait (2, once)
    # -> 0x110 (1) -> 0xb0 (3)
    assert len(key_loop.path) == 13
    assert key_loop.opcodes(sass.ASYNC_COPY_CLASSES) == {"LDGSTS.E.BYPASS.128": 1}
    assert key_loop.opcodes(sass.MMA_CLASSES) == {"HGMMA.64x64x16.F32.BF16": 1}
    assert key_loop.classes()["fp32"] == 2 and key_loop.classes(path=False)["fp32"] == 3


def test_labels_of_the_new_listing_format() -> None:
    listing = """
        /*0000*/                   MOV R1, RZ ;
.L_x_0:
        /*0010*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0020*/                   UTCHMMA gdesc[UR10], gdesc[UR12], tmem[UR14], idesc[UR15] ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   EXIT ;
"""
    loop = sass.main_loop(listing)
    assert loop is not None and loop.header == 0x10 and len(loop.path) == 3
    assert loop.opcodes(sass.ASYNC_COPY_CLASSES) == {"UTMALDG.2D": 1}
    assert loop.opcodes(sass.MMA_CLASSES) == {"UTCHMMA": 1}


def test_set_max_registers_of_warp_specialised_partitions() -> None:
    listing = """
        /*0000*/                   USETMAXREG.TRY_ALLOC.CTAPOOL 0xf0 ;
        /*0010*/                   USETMAXREG.DEALLOC.CTAPOOL 0x58 ;
        /*0020*/                   USETMAXREG.DEALLOC.CTAPOOL 0x58 ;
        /*0030*/                   EXIT ;
"""
    assert sass.set_max_registers(listing) == [0x58, 0xF0]
    assert sass.set_max_registers(LISTING) == []


# A warp-specialised shape: the default partition's MMA loop (0x10) and, past its exit, the
# workers' dispatch loop (0x50, which worker warps branch to) holding an MMA loop (0x60) and a
# copy-only loop (0x90).
PARTITIONED = """
        /*0000*/               @P5 BRA 0x50 ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   EXIT ;
        /*0050*/                   LDS.U8 R0, [R1] ;
        /*0060*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0070*/               @P1 BRA 0x60 ;
        /*0080*/               @P2 BRA 0xc0 ;
        /*0090*/                   LDGSTS.E.BYPASS.128 [R4], desc[UR4][R6.64] ;
        /*00a0*/                   F2FP.BF16.F32.PACK_AB R8, R9, R10 ;
        /*00b0*/               @P3 BRA 0x90 ;
        /*00c0*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*00d0*/               @P4 BRA 0x50 ;
        /*00e0*/                   EXIT ;
"""


def test_partition_loops_are_the_innermost_mma_and_copy_loops() -> None:
    roles, loops = zip(*sass.partition_loops(PARTITIONED), strict=True)
    assert [hex(loop.header) for loop in loops] == ["0x10", "0x60", "0x90"]
    assert roles == ("mma", "mma", "copy")
    assert [len(loop.path) for loop in loops] == [3, 2, 3]
    assert loops[2].opcodes(sass.ASYNC_COPY_CLASSES) == {"LDGSTS.E.BYPASS.128": 1}
    # The dispatch loop holds both kinds, through its inner loops only.
    dispatch = [lp for lp in sass.ControlFlow(sass.parse(PARTITIONED)).loops() if lp.header == 0x50]
    assert dispatch and dispatch[0].inner == (0x60, 0x90)
    assert sass.partition_loops(LISTING)[0][1].header == 0x30  # one partition: the key loop


def test_indirect_jump_targets_are_roots() -> None:
    """sm_100a dispatches worker partitions through a jump table (``BRX``): blocks no branch
    names still get their loops."""
    listing = """
        /*0000*/                   LDC R6, c[0x2][R8] ;
        /*0010*/                   BRX R6 -0x20 ;
        /*0020*/                   EXIT ;
        /*0030*/                   UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], idesc[UR9] ;
        /*0040*/               @P0 BRA 0x30 ;
        /*0050*/                   EXIT ;
        /*0060*/                   LDTM.x16 R4, tmem[UR4] ;
        /*0070*/               @P1 BRA 0x60 ;
        /*0080*/                   EXIT ;
"""
    found = sass.partition_loops(listing)
    assert [hex(loop.header) for _, loop in found] == ["0x30", "0x60"]
    assert [role for role, _ in found] == ["mma", "tmem"]


def test_straight_code_has_no_loop_and_empty_input_is_refused() -> None:
    assert sass.main_loop("        /*0000*/                   EXIT ;\n") is None
    with pytest.raises(ValueError, match="no instructions"):
        sass.main_loop("nothing here")


@pytest.mark.parametrize(
    "op, cls",
    [("LDG.E.128", "ldg"), ("LDGSTS.E.BYPASS.128", "ldgsts"), ("UBLKCP.S.G", "tma"),
     ("UIADD3", "uniform"), ("HGMMA.64x256x16.F32.BF16", "hgmma"), ("UTCQMMA", "tcgen05-mma"),
     ("F2FP.BF16.F32.PACK_AB", "cvt"), ("BOGUS", "other")],
)  # fmt: skip
def test_classes(op: str, cls: str) -> None:
    assert sass.classify(sass.opcode(f"@!P3 {op} R1, R2")) == cls
