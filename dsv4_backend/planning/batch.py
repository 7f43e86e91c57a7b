"""The small, host-agnostic view of one forward batch that planning reads.

Row semantics (one *row* = one query token; ``B`` requests, ``T`` rows):

=============  ==========================================  ====================================
kind           rows of request ``b``                       ``out_cache_loc`` length
=============  ==========================================  ====================================
IDLE           none                                        0
DECODE         one, at position ``seq_lens[b] - 1``        ``B``
DRAFT step i   one, at position ``seq_lens[b] + i``        ``B * topk * num_steps`` (all steps;
                                                           planning takes row ``i`` of the
                                                           ``[B, topk, num_steps]`` layout)
EXTEND         ``extend_seq_lens[b]``, at positions        ``sum(extend_seq_lens)``
               ``prefix[b] ... seq_lens[b] - 1``
DRAFT_EXTEND   as EXTEND; window only (the MTP layer)      ``sum(extend_seq_lens)``
TARGET_VERIFY  ``num_draft_tokens``, at positions          ``B * num_draft_tokens``
               ``seq_lens[b] ... seq_lens[b] + n - 1``
ragged verify  ``ragged.lens[b]``, at positions            ``ragged.num_rows`` (rows past
(TARGET_VERIFY ``seq_lens[b] ... seq_lens[b] + lens[b] - 1``, ``sum(lens)`` are padding: no
with ragged)   packed request after request                write, output 0)
DSPARK_BLOCK   as TARGET_VERIFY (``n`` = the block size),  ``B * num_draft_tokens``
               window only; every row sees the block
=============  ==========================================  ====================================

So ``seq_lens`` counts the tokens already in the cache *including* this forward's for DECODE and
the extend kinds, and *excluding* the speculative tokens for a draft step, for verify and for a
DSpark draft block (as sglang's EAGLE and DSpark workers hand them over). Every row ``r`` at
position ``p`` is planned as a decode row with causal length ``p + 1``, except a DSpark draft
block's, whose rows all see the same keys (``planning/dspark_block.py``).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from dsv4_backend.errors import BatchError

#: Draft trees wider than one token per step are not served (see README).
SUPPORTED_DRAFT_TOPK = (1,)


#: Sequence length of padding requests; the backend's ``get_cuda_graph_seq_len_fill_value()``.
seq_len_fill_value = 1


class ForwardKind(enum.Enum):
    IDLE = "idle"
    DECODE = "decode"
    EXTEND = "extend"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    #: A DSpark draft block (sglang runs it as TARGET_VERIFY on the draft worker).
    DSPARK_BLOCK = "dspark_block"


#: Kinds of ``num_draft_tokens`` rows per request from ``seq_lens[b]`` on.
UNIFORM_BLOCK_KINDS = frozenset({ForwardKind.TARGET_VERIFY, ForwardKind.DSPARK_BLOCK})


@dataclass(frozen=True, kw_only=True)
class DraftStep:
    """Step ``step_id`` of a multi-step EAGLE draft with ``topk`` tokens per step."""

    topk: int
    num_steps: int
    step_id: int

    def __post_init__(self) -> None:
        if self.topk not in SUPPORTED_DRAFT_TOPK:
            raise BatchError(
                f"draft topk={self.topk}; this backend supports topk {SUPPORTED_DRAFT_TOPK} "
                "(start sglang with --speculative-eagle-topk 1)"
            )
        if self.num_steps < 1:
            raise BatchError(f"draft num_steps={self.num_steps}; expected >= 1")
        if not 0 <= self.step_id < self.num_steps:
            raise BatchError(
                f"draft step_id={self.step_id}; expected 0 <= step_id < num_steps={self.num_steps}"
            )


#: The batch's tensors: each must be an integer tensor on ``req_to_token``'s device.
_TENSOR_FIELDS = ("req_to_token", "req_pool_indices", "seq_lens", "out_cache_loc", "full_to_swa")
_INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def host_ints(name: str, values: torch.Tensor | Sequence[int] | None) -> list[int] | None:
    """``values`` as a list of ints; ``name`` is the field, for the error message."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise BatchError(
                f"{name} is on {values.device}; host lengths must be CPU tensors or lists"
            )
        if values.dtype not in _INDEX_DTYPES:
            raise BatchError(f"{name} has dtype {values.dtype}; expected integer host lengths")
        return [int(v) for v in values.tolist()]
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise BatchError(f"{name}={list(values)!r}; expected integer host lengths") from None


def readable_ints(
    name: str, values: torch.Tensor | Sequence[int] | None, *, sync_ok: bool = False
) -> list[int] | None:
    """``values`` (a tensor or ints, the field ``name``) as host ints, checked as
    ``host_ints`` checks them; None when absent, or on the device unless ``sync_ok`` (reading
    it would sync the host with the device)."""
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        if not sync_ok:
            return None
        values = values.cpu()
    return host_ints(name, values)


@dataclass(frozen=True, kw_only=True)
class RaggedVerify:
    """A verify whose requests verify their own number of tokens (sglang's compact ragged
    verify, ``SGLANG_RAGGED_VERIFY_MODE=compact``; docs/planning.md, "Ragged verify").

    ``lens`` ``[B]`` int (on the batch's device): rows of each request, packed request after
    request; ``num_rows``: the batch's rows (sglang's token bucket ``graph_num_tokens``), of
    which the first ``sum(lens)`` are the requests' and the rest padding rows, planned as
    writing nothing and attending to nothing; ``lens_cpu``: ``lens`` on the host when known
    without a device sync (eager plans size their page table from it).
    """

    lens: torch.Tensor
    num_rows: int
    lens_cpu: Sequence[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lens_cpu", host_ints("ragged lens_cpu", self.lens_cpu))
        if self.lens_cpu is None and self.lens.device.type == "cpu":
            object.__setattr__(self, "lens_cpu", host_ints("ragged lens", self.lens))


@dataclass(frozen=True, kw_only=True)
class BatchView:
    """What planning needs to know about a batch; shapes are checked on construction.

    Parameters
    ----------
    kind : ForwardKind
    req_pool_indices : Tensor ``[B]`` int — row of each request in ``req_to_token``.
    seq_lens : Tensor ``[B]`` int — see the module table for what it counts per kind.
    out_cache_loc : Tensor ``[N]`` int64 — full-cache slot written by each new token.
    req_to_token : Tensor ``[pool_rows, max_context]`` int32 — full-cache slot of every token
        of every request (pages of 256 consecutive slots).
    seq_lens_cpu : optional host copy of ``seq_lens``; lets eager planning size its outputs
        and check values without a device sync.
    extend_prefix_lens, extend_seq_lens : host lengths ``[B]`` for EXTEND / DRAFT_EXTEND.
    num_draft_tokens : tokens per request for TARGET_VERIFY and DSPARK_BLOCK.
    ragged : a TARGET_VERIFY whose requests verify their own number of tokens
        (``RaggedVerify``); its rows replace the ``num_draft_tokens`` a request.
    draft : the step of a multi-step draft, for DECODE only.
    full_to_swa : optional Tensor ``[full_pool_slots]`` int — window-cache slot of each full
        slot; identity when omitted.
    num_cache_slots : optional number of full-cache slots; ``out_cache_loc`` and every slot the
        plan reads from ``req_to_token`` must lie in ``[0, num_cache_slots)`` (and inside
        ``full_to_swa`` when given).
    num_swa_slots : optional number of window-cache slots; the window slot of every write and
        of every window key the plan reads must lie in ``[0, num_swa_slots)``.
    window_floors : optional host positions ``[B]`` for EXTEND: request ``b``'s rows read the
        window keys at positions ``>= window_floors[b]`` only, ``0 <= floor <= prefix``
        (DeepSeek-V4.1's late-layer tail, ``planning/tail.py``); every key of the window when
        omitted.

    The tensors all live on ``req_to_token``'s device and have an integer dtype; the host
    lengths are lists. Construction checks shapes, dtypes, devices and host lengths; the values
    of the device tensors (index ranges, write slots) are checked by ``plan``
    (``planning/checks.py``).
    """

    kind: ForwardKind
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    seq_lens_cpu: torch.Tensor | Sequence[int] | None = None
    extend_prefix_lens: torch.Tensor | Sequence[int] | None = None
    extend_seq_lens: torch.Tensor | Sequence[int] | None = None
    num_draft_tokens: int | None = None
    draft: DraftStep | None = None
    full_to_swa: torch.Tensor | None = None
    num_cache_slots: int | None = None
    num_swa_slots: int | None = None
    window_floors: Sequence[int] | None = None
    ragged: RaggedVerify | None = None

    def __post_init__(self) -> None:
        for name in ("seq_lens_cpu", "extend_prefix_lens", "extend_seq_lens", "window_floors"):
            object.__setattr__(self, name, host_ints(name, getattr(self, name)))
        for name in _TENSOR_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None and (
                not isinstance(tensor, torch.Tensor) or tensor.dtype not in _INDEX_DTYPES
            ):
                got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise BatchError(
                    f"{name} has dtype {got}; expected an integer tensor (int32 or int64)"
                )
        bs = self.req_pool_indices.numel()
        if self.req_pool_indices.dim() != 1 or self.seq_lens.dim() != 1:
            raise BatchError(
                "req_pool_indices and seq_lens must be 1-D, got shapes "
                f"{tuple(self.req_pool_indices.shape)} and {tuple(self.seq_lens.shape)}"
            )
        if self.seq_lens.numel() != bs:
            raise BatchError(
                f"seq_lens has {self.seq_lens.numel()} entries but req_pool_indices has {bs}; "
                "expected one of each per request"
            )
        if self.req_to_token.dim() != 2:
            raise BatchError(
                "req_to_token must be 2-D [pool_rows, max_context], got "
                f"{tuple(self.req_to_token.shape)}"
            )
        device = self.req_to_token.device
        for name in _TENSOR_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None and tensor.device != device:
                raise BatchError(
                    f"{name} is on {tensor.device} but req_to_token is on {device}; planning "
                    "reads every batch tensor on one device"
                )
        if self.seq_lens_cpu is not None and len(self.seq_lens_cpu) != bs:
            raise BatchError(f"seq_lens_cpu has {len(self.seq_lens_cpu)} entries, expected {bs}")
        if self.draft is not None and self.kind is not ForwardKind.DECODE:
            raise BatchError(f"draft steps are DECODE batches, got kind {self.kind.name}")
        host = self.host_seq_lens
        if host is not None and any(v < 1 for v in host):
            raise BatchError(f"seq_lens must be >= 1, got {host}")
        self._check_kind(bs)
        expected = self.expected_out_cache_loc_len
        if self.out_cache_loc.dim() != 1 or self.out_cache_loc.numel() != expected:
            raise BatchError(self._out_cache_loc_message(expected))

    # -------------------------------------------------------------------------- properties
    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.numel()

    @property
    def host_seq_lens(self) -> list[int] | None:
        """``seq_lens`` on the host when known without a device sync."""
        if self.seq_lens_cpu is not None:
            return list(self.seq_lens_cpu)
        if self.seq_lens.numel() == 0:  # IDLE: its shape says it all, on any device
            return []
        if self.seq_lens.device.type == "cpu":
            return [int(v) for v in self.seq_lens.tolist()]
        return None

    @property
    def rows_per_request(self) -> int | None:
        """Query rows of every request for the uniform kinds; None for extend kinds."""
        if self.kind is ForwardKind.IDLE:
            return 0
        if self.kind is ForwardKind.DECODE:
            return 1
        if self.kind in UNIFORM_BLOCK_KINDS and self.ragged is None:
            return self.num_draft_tokens
        return None

    @property
    def num_rows(self) -> int:
        """``T``, the query rows this batch plans."""
        if self.ragged is not None:
            return self.ragged.num_rows
        per = self.rows_per_request
        if per is not None:
            return per * self.batch_size
        return sum(self.extend_seq_lens or ())

    @property
    def expected_out_cache_loc_len(self) -> int:
        if self.draft is not None:
            return self.batch_size * self.draft.topk * self.draft.num_steps
        return self.num_rows

    # ---------------------------------------------------------------------------- checks
    def _check_kind(self, bs: int) -> None:
        kind = self.kind
        if kind is ForwardKind.IDLE and bs != 0:
            raise BatchError(f"an IDLE batch has no requests, got batch size {bs}")
        if kind in UNIFORM_BLOCK_KINDS and (
            self.num_draft_tokens is None or self.num_draft_tokens < 1
        ):
            raise BatchError(
                f"{kind.name} needs num_draft_tokens >= 1, got {self.num_draft_tokens}"
            )
        if kind in (ForwardKind.EXTEND, ForwardKind.DRAFT_EXTEND):
            prefix, extend = self.extend_prefix_lens, self.extend_seq_lens
            if prefix is None or extend is None:
                raise BatchError(f"{kind.name} needs host extend_prefix_lens and extend_seq_lens")
            if len(prefix) != bs or len(extend) != bs:
                raise BatchError(
                    f"{kind.name}: extend_prefix_lens has {len(prefix)} and extend_seq_lens "
                    f"{len(extend)} entries, expected batch size {bs}"
                )
            if any(e < 1 for e in extend) or any(p < 0 for p in prefix):
                raise BatchError(
                    f"{kind.name}: extend_seq_lens must be >= 1 and prefixes >= 0, got "
                    f"extend {extend} and prefix {prefix}"
                )
            host = self.host_seq_lens
            if host is not None and [p + e for p, e in zip(prefix, extend, strict=True)] != host:
                raise BatchError(
                    f"{kind.name}: seq_lens {host} != extend_prefix_lens + extend_seq_lens "
                    f"{[p + e for p, e in zip(prefix, extend, strict=True)]}"
                )
        if self.ragged is not None:
            self._check_ragged(bs)
        floors = self.window_floors
        if floors is not None:
            prefix = self.extend_prefix_lens
            if kind is not ForwardKind.EXTEND or prefix is None:
                raise BatchError(f"window_floors are for EXTEND batches, got kind {kind.name}")
            if len(floors) != bs or any(
                not 0 <= f <= p for f, p in zip(floors, prefix, strict=True)
            ):
                raise BatchError(
                    f"window_floors={list(floors)}; expected one per request with 0 <= floor <= "
                    f"its prefix (extend_prefix_lens={list(prefix)})"
                )

    def _check_ragged(self, bs: int) -> None:
        ragged = cast(RaggedVerify, self.ragged)
        if self.kind is not ForwardKind.TARGET_VERIFY:
            raise BatchError(f"ragged verify lengths are for TARGET_VERIFY, got {self.kind.name}")
        lens = ragged.lens
        if (
            not isinstance(lens, torch.Tensor)
            or lens.dtype not in _INDEX_DTYPES
            or lens.shape != (bs,)
            or lens.device != self.req_to_token.device
        ):
            got: object = lens
            if isinstance(lens, torch.Tensor):
                got = (lens.dtype, tuple(lens.shape), lens.device)
            raise BatchError(
                f"ragged verify lens {got}; expected an integer tensor of shape ({bs},) on "
                f"{self.req_to_token.device}, one row count per request"
            )
        host = ragged.lens_cpu
        if host is not None and (
            len(host) != bs or min(host, default=0) < 0 or sum(host) > ragged.num_rows
        ):
            raise BatchError(
                f"ragged verify lens {list(host)}; expected {bs} counts >= 0 that fit the "
                f"batch's {ragged.num_rows} rows"
            )

    def _out_cache_loc_message(self, expected: int) -> str:
        got = tuple(self.out_cache_loc.shape)
        if self.draft is not None:
            d = self.draft
            return (
                f"out_cache_loc has shape {got}; a multi-step draft batch needs batch_size * "
                f"topk * num_steps = {self.batch_size} * {d.topk} * {d.num_steps} = {expected} "
                "write slots laid out [batch_size, topk, num_steps]"
            )
        return (
            f"out_cache_loc has shape {got}; a {self.kind.name} batch of {self.batch_size} "
            f"requests needs {expected} write slots (one per query row)"
        )
