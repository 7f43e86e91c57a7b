"""Requests in a paged KV pool with scattered pages, and the batch views of every kind."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError
from dsv4_backend.planning.batch import BatchView, DraftStep, ForwardKind, RaggedVerify


class PagedRequestPool:
    """``req_to_token`` for a fixed set of requests, pages scattered at random.

    Request ``i`` lives in pool row ``i + 1`` (row 0 is the padding row, as in sglang) and owns
    ``ceil(max_len / 256)`` pages drawn from a random permutation of the pool's pages but page 0
    (sglang's padding page: padded rows write slot 0, see :meth:`pad_requests`); the window
    cache is addressed through ``full_to_swa``, a random permutation of whole pages that keeps
    each token's offset inside its page (as sglang's paged SWA allocator does), so that a plan
    using full slots where window slots are due is caught. Page 0 maps to window page 0, as
    sglang maps its padding slot 0 to window slot 0.

    Prefix caching (how sglang's radix cache hands a hit to the backend): ``shared_pages[i] =
    (j, n)`` makes request ``i``'s first ``n`` pages request ``j``'s first ``n`` pages (its
    ``req_to_token`` row points at them; ``j < i``). With ``same_tokens[i] = (j, m)`` request
    ``i``'s first ``m`` tokens are ``j``'s (``RandomModel`` copies their inputs): both
    together, ``m >= 256 n``, are a prefix hit of ``256 n`` tokens; tokens alone are a prefix
    recomputed after eviction; pages alone reuse a finished request's pages.

    Attributes
    ----------
    req_to_token : ``[num_requests + 1, max_context]`` int32 full slots.
    full_to_swa : ``[num_full_slots]`` int64 window slot of each full slot:
        ``swa_page(page) * 256 + offset`` for full slot ``page * 256 + offset``.
    full_size, swa_size : the sizes a real KV pool reports for these pages (sglang's
        allocators hand out pages ``1 ... size / 256`` over ``size + 256`` slots):
        ``num_full_slots - 256`` both, so the top page is in use.
    """

    def __init__(
        self,
        config: DSV4AttentionConfig,
        max_lens: Sequence[int],
        *,
        generator: torch.Generator,
        spare_pages: int = 3,
        device: torch.device | str = "cpu",
        shared_pages: Mapping[int, tuple[int, int]] | None = None,
        same_tokens: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        if not max_lens or min(max_lens) < 1:
            raise BatchError(f"max_lens must be positive request lengths, got {list(max_lens)}")
        if spare_pages < 1:
            raise BatchError(f"spare_pages={spare_pages}; expected >= 1 (page 0 is padding)")
        page = config.page_size
        self.shared_pages = dict(shared_pages or {})
        self.same_tokens = dict(same_tokens or {})
        _check_prefixes(max_lens, page, self.shared_pages, self.same_tokens)
        pages_per_request = [math.ceil(n / page) for n in max_lens]
        own_pages = [
            count - self.shared_pages.get(i, (i, 0))[1] for i, count in enumerate(pages_per_request)
        ]
        self.num_pages = sum(own_pages) + spare_pages
        self.max_context = max(pages_per_request) * page
        self.num_full_slots = self.num_pages * page
        order = 1 + torch.randperm(self.num_pages - 1, generator=generator)
        req_to_token = torch.zeros(len(max_lens) + 1, self.max_context, dtype=torch.int32)
        offsets = torch.arange(page, dtype=torch.int32)
        taken = 0
        for i in range(len(max_lens)):
            owner, shared = self.shared_pages.get(i, (i, 0))
            req_to_token[i + 1, : shared * page] = req_to_token[owner + 1, : shared * page]
            for k in range(shared, pages_per_request[i]):
                start = int(order[taken]) * page
                req_to_token[i + 1, k * page : (k + 1) * page] = start + offsets
                taken += 1
        self.device = torch.device(device)
        self.req_to_token = req_to_token.to(self.device)
        swa_pages = torch.randperm(self.num_pages, generator=generator)
        # Page 0 maps to window page 0 (the docstring): swapped into place.
        zero = int(torch.nonzero(swa_pages == 0)[0])
        swa_pages[[0, zero]] = swa_pages[[zero, 0]]
        self.full_to_swa = (swa_pages[:, None] * page + offsets.long()).flatten().to(self.device)
        self.full_size = self.swa_size = self.num_full_slots - page
        self.max_lens = list(max_lens)

    @property
    def num_requests(self) -> int:
        return len(self.max_lens)

    def pool_index(self, request: int) -> int:
        return request + 1

    def slots(self, request: int, positions: Sequence[int]) -> torch.Tensor:
        """Full slots of ``positions`` of ``request``: ``[len(positions)]`` int64."""
        if positions and max(positions) >= self.max_lens[request]:
            raise BatchError(
                f"request {request} has room for {self.max_lens[request]} tokens, "
                f"position {max(positions)} asked"
            )
        row = self.req_to_token[self.pool_index(request)]
        return row[torch.tensor(list(positions), dtype=torch.long, device=self.device)].long()

    # -------------------------------------------------------------------------- batch views
    def _view(
        self,
        kind: ForwardKind,
        requests: Sequence[int],
        seq_lens: Sequence[int],
        out_cache_loc: torch.Tensor,
        **extra: Any,
    ) -> BatchView:
        device = self.device
        return BatchView(
            kind=kind,
            req_pool_indices=torch.tensor(
                [self.pool_index(r) for r in requests], dtype=torch.int64, device=device
            ),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int64, device=device),
            seq_lens_cpu=list(seq_lens),
            out_cache_loc=out_cache_loc,
            req_to_token=self.req_to_token,
            full_to_swa=self.full_to_swa,
            **extra,
        )

    def _cat_slots(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        if not pieces:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.cat(pieces)

    def extend(
        self,
        requests: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        *,
        draft_model: bool = False,
    ) -> BatchView:
        """EXTEND (or DRAFT_EXTEND): request ``i`` adds positions ``prefix ... seq_len - 1``."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        loc = self._cat_slots(
            [
                self.slots(r, range(p, s))
                for r, p, s in zip(requests, prefix_lens, seq_lens, strict=True)
            ]
        )
        kind = ForwardKind.DRAFT_EXTEND if draft_model else ForwardKind.EXTEND
        return self._view(
            kind,
            requests,
            seq_lens,
            loc,
            extend_prefix_lens=list(prefix_lens),
            extend_seq_lens=list(extend_lens),
        )

    def decode(self, requests: Sequence[int], seq_lens: Sequence[int]) -> BatchView:
        """DECODE: request ``i`` decodes position ``seq_lens[i] - 1``."""
        loc = self._cat_slots(
            [self.slots(r, [s - 1]) for r, s in zip(requests, seq_lens, strict=True)]
        )
        return self._view(ForwardKind.DECODE, requests, seq_lens, loc)

    def verify(
        self,
        requests: Sequence[int],
        seq_lens: Sequence[int],
        num_draft_tokens: int,
        *,
        kind: ForwardKind = ForwardKind.TARGET_VERIFY,
    ) -> BatchView:
        """TARGET_VERIFY: ``num_draft_tokens`` rows per request from position ``seq_lens[i]``;
        ``kind=DSPARK_BLOCK``: a DSpark draft block of that many rows, the same slots."""
        loc = self._cat_slots(
            [
                self.slots(r, range(s, s + num_draft_tokens))
                for r, s in zip(requests, seq_lens, strict=True)
            ]
        )
        return self._view(kind, requests, seq_lens, loc, num_draft_tokens=num_draft_tokens)

    def ragged_verify(
        self,
        requests: Sequence[int],
        seq_lens: Sequence[int],
        lens: Sequence[int],
        num_rows: int,
        *,
        padding: Sequence[int] = (),
    ) -> BatchView:
        """A ragged TARGET_VERIFY (sglang's compact verify): ``lens[i]`` rows of request ``i``
        from position ``seq_lens[i]``, packed, then one padding request (pool row 0,
        ``seq_lens`` 1) per ``padding`` entry with that many rows; ``out_cache_loc`` padded
        with slot 0 to ``num_rows`` (sglang's ragged verify window)."""
        loc = self._cat_slots(
            [
                self.slots(r, range(s, s + n))
                for r, s, n in zip(requests, seq_lens, lens, strict=True)
            ]
        )
        loc = torch.nn.functional.pad(loc, (0, num_rows - loc.numel()))
        pool_rows = [*(self.pool_index(r) for r in requests), *[0] * len(padding)]
        return BatchView(
            kind=ForwardKind.TARGET_VERIFY,
            req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(
                [*seq_lens, *[1] * len(padding)], dtype=torch.int64, device=self.device
            ),
            seq_lens_cpu=[*seq_lens, *[1] * len(padding)],
            out_cache_loc=loc,
            req_to_token=self.req_to_token,
            full_to_swa=self.full_to_swa,
            num_draft_tokens=max([*lens, *padding], default=1),
            ragged=RaggedVerify(
                lens=torch.tensor([*lens, *padding], dtype=torch.int32, device=self.device),
                num_rows=num_rows,
            ),
        )

    def draft_out_cache_loc(
        self, requests: Sequence[int], seq_lens: Sequence[int], num_steps: int
    ) -> torch.Tensor:
        """The draft batch's write slots, laid out ``[B, topk=1, num_steps]``."""
        return self._cat_slots(
            [
                self.slots(r, range(s, s + num_steps))
                for r, s in zip(requests, seq_lens, strict=True)
            ]
        )

    def draft_step(
        self,
        requests: Sequence[int],
        seq_lens: Sequence[int],
        num_steps: int,
        step_id: int,
        out_cache_loc: torch.Tensor | None = None,
    ) -> BatchView:
        """Step ``step_id`` of a topk-1 draft: one row per request at ``seq_lens[i] + step_id``."""
        if out_cache_loc is None:
            out_cache_loc = self.draft_out_cache_loc(requests, seq_lens, num_steps)
        return self._view(
            ForwardKind.DECODE,
            requests,
            seq_lens,
            out_cache_loc,
            draft=DraftStep(topk=1, num_steps=num_steps, step_id=step_id),
        )

    def idle(self) -> BatchView:
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return BatchView(
            kind=ForwardKind.IDLE,
            req_pool_indices=empty,
            seq_lens=empty,
            out_cache_loc=empty,
            req_to_token=self.req_to_token,
            full_to_swa=self.full_to_swa,
        )

    def pad_requests(self, view: BatchView, extra: int) -> BatchView:
        """``view`` with ``extra`` requests appended as data-parallel padding lays them out
        (sglang's ``ForwardBatch._pad_inputs_to_size``): pool row 0, ``seq_lens`` 1, every write
        slot 0. For the uniform kinds (DECODE, draft steps, TARGET_VERIFY, DSPARK_BLOCK)."""
        rows_per_request = view.rows_per_request
        if rows_per_request is None or view.kind is ForwardKind.IDLE:
            raise BatchError(
                f"{view.kind.name}: request padding is for DECODE, draft steps, TARGET_VERIFY "
                "and DSPARK_BLOCK"
            )
        draft = view.draft
        slots_per_request = draft.topk * draft.num_steps if draft else rows_per_request
        zeros = torch.zeros(extra, dtype=torch.int64, device=self.device)
        return BatchView(
            kind=view.kind,
            req_pool_indices=torch.cat([view.req_pool_indices, zeros]),
            seq_lens=torch.cat([view.seq_lens, zeros + 1]),
            seq_lens_cpu=[*(view.host_seq_lens or view.seq_lens.tolist()), *[1] * extra],
            out_cache_loc=torch.cat(
                [view.out_cache_loc, zeros.new_zeros(extra * slots_per_request)]
            ),
            req_to_token=view.req_to_token,
            full_to_swa=view.full_to_swa,
            num_draft_tokens=view.num_draft_tokens,
            draft=view.draft,
        )


def _check_prefixes(
    max_lens: Sequence[int],
    page: int,
    shared_pages: Mapping[int, tuple[int, int]],
    same_tokens: Mapping[int, tuple[int, int]],
) -> None:
    """``BatchError`` unless every shared prefix names an earlier request with a prefix that
    long."""
    n = len(max_lens)
    for what, spec, unit in (("shared_pages", shared_pages, page), ("same_tokens", same_tokens, 1)):
        for i, (j, count) in spec.items():
            ok = 0 <= j < i < n and count > 0
            if not ok or any(count > math.ceil(max_lens[r] / unit) for r in (i, j)):
                raise BatchError(
                    f"{what}[{i}] = ({j}, {count}): expected an earlier request j and a prefix "
                    f"of {count} {'pages' if unit > 1 else 'tokens'} within both requests' "
                    f"lengths {list(max_lens)}"
                )
