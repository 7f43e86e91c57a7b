"""Read a kernel's loops from its SASS listing (``cuobjdump -sass``), for roofline models.

The listing is split into basic blocks; a loop is a natural loop of the control-flow graph (a
back edge ``u -> h`` where ``h`` dominates ``u``, plus every block that reaches ``u`` without
passing ``h``). So out-of-line blocks that ptxas moves past the function's end -- mbarrier wait
spins that branch back into the body -- count as part of the loop that enters them, and the
spins themselves are inner loops.

Instructions per iteration (:attr:`Loop.path`): the longest path from the header back to it
through the body, inner loops passed once (a wait that does not spin), so a branch taken on
alternate iterations (the two spans' gathers of the attention kernel) counts once, not twice.
A predicated-off instruction still issues, so on a path the static count is the dynamic one
per warp and iteration.

Instruction classes are the ones a roofline model needs: global loads, asynchronous copies
(``LDGSTS``; ``UTMALDG`` / ``UBLKCP``: TMA), shared-memory traffic, tensor-core MMAs (Hopper
``HGMMA``, Blackwell ``UTC*MMA``, ``HMMA``), conversions, fp32 ALU, ``MUFU``, integer ALU...
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"(?:`\((\.L_x_\d+)\)|\b(0x[0-9a-f]+))\s*$")
_GUARD = re.compile(r"^@!?U?P[T0-9]+\s+")
_SETMAXREG = re.compile(r"USETMAXREG[^;]*?(0x[0-9a-f]+)\s*;")

#: ``(class, opcode regex)``, first match wins (asynchronous copies and MMAs before the
#: catch-all uniform-datapath class).
CLASSES = (
    ("ldgsts", r"^LDGSTS\b"),
    ("tma", r"^(UTMALDG|UBLKCP|UTMAPF)\b"),
    ("tma-store", r"^(UTMASTG|UTMAREDG|UBLKRED)\b"),
    ("async-wait", r"^(LDGDEPBAR|DEPBAR|SYNCS)\b"),
    ("ldg", r"^LDG\b"),
    ("stg", r"^(STG|RED|ATOM)\b"),
    ("lds", r"^(LDS|LDSM)\b"),
    ("sts", r"^(STS|STSM)\b"),
    ("hgmma", r"^HGMMA\b"),
    ("tcgen05-mma", r"^UTC[A-Z]*MMA\b"),
    ("mma.sync", r"^(HMMA|IMMA|QMMA)\b"),
    ("tmem", r"^(LDTM|STTM)\b"),
    ("tmem-control", r"^(UTCBAR|UTCCP|UTCATOM\w*)\b"),
    ("warpgroup", r"^WARPGROUP\b"),
    ("barrier", r"^(BAR|MEMBAR|FENCE|ARRIVES|WARPSYNC|ERRBAR|CCTL)\b"),
    ("cvt", r"^(F2FP|F2F|I2F|F2I|I2FP|F2IP|HADD2\.F32|FRND)\b"),
    ("mufu", r"^MUFU\b"),
    ("fp32", r"^(FADD|FADD2|FMUL|FMUL2|FFMA|FFMA2|FMNMX|FMNMX3|FSEL|FSETP|FCHK|FSWZADD)\b"),
    ("fp16x2", r"^(HADD2|HMUL2|HFMA2|HMNMX2)\b"),
    (
        "int",
        r"^(IMAD|IADD3|IADD|LOP3|SHF|LEA|ISETP|SEL|IMNMX|VIMNMX|VIMNMX3|VIADD|VIADDMNMX"
        r"|IABS|POPC|FLO|BMSK|SGXT|IMUL|BREV)\b",
    ),
    ("move", r"^(PRMT|MOV|MOVM|P2R|R2P|CS2R|S2R|S2UR|R2UR|LDC|LDCU|ULDC)\b"),
    ("shfl", r"^(SHFL|REDUX)\b"),
    ("uniform", r"^U[A-Z0-9]+\b"),
    ("predicate", r"^(PLOP3|VOTE|VOTEU|MATCH|ELECT)\b"),
    ("control", r"^(BRA|BRX|JMP|JMX|BSSY|BSYNC|EXIT|CALL|RET|NOP|YIELD|BPT|NANOSLEEP|ACQBULK)\b"),
)
_CLASS_RES = tuple((name, re.compile(rx)) for name, rx in CLASSES)
#: Classes that are asynchronous global -> shared copies.
ASYNC_COPY_CLASSES = ("ldgsts", "tma")
#: Classes that are tensor-core MMAs.
MMA_CLASSES = ("hgmma", "tcgen05-mma", "mma.sync")


def opcode(text: str) -> str:
    """The opcode of an instruction's text (predicate guard stripped): ``LDG.E.128``."""
    parts = _GUARD.sub("", text).split()
    return parts[0] if parts else ""


def classify(op: str) -> str:
    """The class of opcode ``op`` (:data:`CLASSES`), ``other`` when none matches."""
    return next((name for name, rx in _CLASS_RES if rx.search(op)), "other")


@dataclass(frozen=True)
class Instruction:
    addr: int
    text: str

    @property
    def op(self) -> str:
        return opcode(self.text)

    @property
    def guarded(self) -> bool:
        """Executed under a predicate (a conditional branch or exit when it is one)."""
        return bool(_GUARD.match(self.text)) or bool(re.match(r"^BRA\.U\s+!?UP\d", self.text))


def parse(listing: str) -> list[Instruction]:
    """The instructions of the first function of ``listing`` in address order; labels
    (``.L_x_N:``) of the new listing format are resolved into branch targets."""
    insns: list[Instruction] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in listing.splitlines():
        if "Function :" in line and insns:
            break  # the next function
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSN.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        labels.update((name, addr) for name in pending)
        pending = []
        insns.append(Instruction(addr, m.group(2).strip()))
    return [
        Instruction(i.addr, re.sub(r"`\((\.L_x_\d+)\)", lambda m: hex(labels[m.group(1)]), i.text))
        for i in insns
    ]


def _branch_target(insn: Instruction) -> int | None:
    if not insn.op.startswith("BRA"):
        return None
    m = _TARGET.search(insn.text)
    return int(m.group(2), 16) if m and m.group(2) else None


@dataclass(frozen=True)
class Loop:
    """A natural loop: ``header`` address, ``blocks`` (start addresses of its basic blocks),
    ``instructions`` (every instruction of the body, static), ``path`` (the instructions of the
    longest header-to-header path, inner loops once) and ``inner`` (headers of the loops
    nested in it)."""

    header: int
    blocks: frozenset[int]
    instructions: tuple[Instruction, ...]
    path: tuple[Instruction, ...]
    inner: tuple[int, ...]

    def classes(self, *, path: bool = True) -> dict[str, int]:
        """Instruction count per class, most common first (of the path, or of the body)."""
        insns = self.path if path else self.instructions
        return dict(collections.Counter(classify(i.op) for i in insns).most_common())

    def opcodes(self, classes: tuple[str, ...]) -> dict[str, int]:
        """Static count per opcode of the body's instructions in ``classes``."""
        ops = (i.op for i in self.instructions if classify(i.op) in classes)
        return dict(collections.Counter(ops).most_common())


class ControlFlow:
    """Basic blocks, edges, dominators and natural loops of one function's instructions."""

    def __init__(self, insns: list[Instruction]) -> None:
        if not insns:
            raise ValueError("no instructions in the SASS listing")
        self.insns = insns
        addrs = [i.addr for i in insns]
        leaders = {addrs[0]}
        for n, insn in enumerate(insns):
            target = _branch_target(insn)
            ends = target is not None or insn.op in ("EXIT", "RET") or insn.op.startswith("RET.")
            if target is not None:
                leaders.add(target)
            if ends and n + 1 < len(insns):
                leaders.add(addrs[n + 1])
        self.blocks: dict[int, list[Instruction]] = {}
        for insn in insns:
            if insn.addr in leaders:
                current = self.blocks.setdefault(insn.addr, [])
            current.append(insn)
        starts = list(self.blocks)
        self.succ: dict[int, list[int]] = {}
        for n, start in enumerate(starts):
            last = self.blocks[start][-1]
            nxt = starts[n + 1] if n + 1 < len(starts) else None
            target = _branch_target(last)
            stops = last.op == "EXIT" or last.op.startswith("RET")
            out = []
            if target is not None and target in self.blocks:
                out.append(target)
            if nxt is not None and (last.guarded or (target is None and not stops)):
                out.append(nxt)
            self.succ[start] = list(dict.fromkeys(out))
        self.pred: dict[int, list[int]] = {b: [] for b in self.blocks}
        for b, outs in self.succ.items():
            for s in outs:
                self.pred[s].append(b)
        self.dom = self._dominators(starts[0])

    def _dominators(self, entry: int) -> dict[int, set[int]]:
        """``dom[b]``: the blocks that dominate ``b`` (iterative data-flow). Code no branch
        reaches from ``entry`` is entered at its first block, a root beside ``entry``: the
        targets of an indirect jump (``BRX`` through a jump table, as warp-specialised
        partitions dispatch on sm_100a)."""
        roots, reach = [], set()
        for root in [entry, *self.blocks]:
            if root in reach:
                continue
            roots.append(root)
            reach.add(root)
            stack = [root]
            while stack:
                for s in self.succ[stack.pop()]:
                    if s not in reach:
                        reach.add(s)
                        stack.append(s)
        order = list(self.blocks)
        dom = {b: set(order) for b in order}
        for root in roots:
            dom[root] = {root}
        changed = True
        while changed:
            changed = False
            for b in (b for b in order if b not in roots):
                preds = [dom[p] for p in self.pred[b] if p in dom]
                new = set.intersection(*preds) | {b} if preds else {b}
                if new != dom[b]:
                    dom[b], changed = new, True
        return dom

    def loops(self) -> list[Loop]:
        """Natural loops (back edges to one header merged), largest body first."""
        bodies: dict[int, set[int]] = {}
        for u, outs in self.succ.items():
            for h in outs:
                if u in self.dom and h in self.dom[u]:  # back edge u -> h
                    body = bodies.setdefault(h, {h})
                    stack = [u]
                    while stack:
                        b = stack.pop()
                        if b not in body:
                            body.add(b)
                            stack.extend(p for p in self.pred[b] if p in self.dom)
        out = []
        for h, body in bodies.items():
            inner = tuple(sorted(g for g in bodies if g != h and g in body))
            out.append(
                Loop(
                    header=h,
                    blocks=frozenset(body),
                    instructions=tuple(i for b in sorted(body) for i in self.blocks[b]),
                    path=self._longest_path(h, body, bodies),
                    inner=inner,
                )
            )
        return sorted(out, key=lambda loop: -len(loop.instructions))

    def _longest_path(
        self, header: int, body: set[int], bodies: dict[int, set[int]]
    ) -> tuple[Instruction, ...]:
        """The instructions of the longest path header -> a latch (a block with an edge back
        to ``header``) inside ``body``, with every back edge (of this loop and of inner loops)
        removed."""
        headers = {g for g in bodies if g in body}

        def forward(b: int) -> list[int]:
            return [
                s for s in self.succ[b] if s in body and not (s in headers and s in self.dom[b])
            ]

        best: dict[int, tuple[int, ...] | None] = {}  # block -> longest block path to a latch

        def walk(b: int, active: set[int]) -> tuple[int, ...] | None:
            if b in best:
                return best[b]
            active.add(b)
            tails = [walk(s, active) for s in forward(b) if s not in active]
            active.discard(b)
            paths = [t for t in tails if t is not None]
            if header in self.succ[b]:
                paths.append(())
            if not paths:
                best[b] = None
                return None
            tail = max(paths, key=lambda t: sum(len(self.blocks[x]) for x in t))
            best[b] = (b, *tail)
            return best[b]

        blocks = walk(header, set()) or (header,)
        return tuple(i for b in blocks for i in self.blocks[b])


def set_max_registers(listing: str) -> list[int]:
    """The register counts a warp-specialised kernel's partitions set (``setmaxnreg``:
    ``USETMAXREG``), ascending; empty for a kernel of one partition."""
    return sorted({int(v, 16) for v in _SETMAXREG.findall(listing)})


def main_loop(listing: str) -> Loop | None:
    """The loop of ``listing`` with the most tensor-core MMAs in its body (the key-block loop
    of an attention kernel), else the largest; None without loops."""
    loops = ControlFlow(parse(listing)).loops()
    if not loops:
        return None

    def mma_count(loop: Loop) -> int:
        return sum(classify(i.op) in MMA_CLASSES for i in loop.instructions)

    return max(loops, key=lambda loop: (mma_count(loop), len(loop.instructions)))


#: What a warp-specialised partition's key loop does, by the first of these its body holds:
#: MMAs (Hopper's consumers, Blackwell's MMA warp), asynchronous copies (a producer), tensor
#: memory loads and stores (Blackwell's softmax).
PARTITION_ROLES = (("mma", MMA_CLASSES), ("copy", ASYNC_COPY_CLASSES), ("tmem", ("tmem",)))


def partition_loops(listing: str) -> list[tuple[str, Loop]]:
    """``(role, loop)`` for the innermost loops of ``listing`` that hold tensor-core MMAs,
    asynchronous copies or tensor-memory loads and stores, in address order: a warp-specialised
    kernel's per-partition key loops (the loop through which the worker partitions dispatch
    holds theirs, so it is left out). The role is the first of :data:`PARTITION_ROLES` a loop
    holds and none of its inner loops does."""
    loops = ControlFlow(parse(listing)).loops()
    by_header = {loop.header: loop for loop in loops}

    def holds(loop: Loop, classes: tuple[str, ...]) -> bool:
        return any(classify(i.op) in classes for i in loop.instructions)

    keep = []
    for loop in loops:
        for role, classes in PARTITION_ROLES:
            if holds(loop, classes) and not any(holds(by_header[h], classes) for h in loop.inner):
                keep.append((role, loop))
                break
    return sorted(keep, key=lambda found: found[1].header)
