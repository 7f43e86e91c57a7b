"""Host-side helpers of the sparse-attention op shared by its variants and callers: the input
checks, the key-split counts, the row grouping and the key lists of a launch
(:class:`KeySpans`), the output and dot-operand dtypes and the op's tolerance, and the fp8
requirements the pipelined and ws kernels share."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import triton

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.kernels.attention.key_union import MAX_GROUP, key_union

#: Most heads per program: one wgmma M tile (all 64 heads of DeepSeek-V4-Flash).
MAX_BLOCK_H = 64
#: Upper bound of key splits per row (the merge kernel takes them in one tile).
MAX_SPLITS = 32
#: Rope channels the pipelined and ws kernels take (the last 64 of the head, bf16 in the cache).
ROPE_DIM = 64


# ------------------------------------------------------------------------------- checks
#: A compressed layer's keys: ``(extra cache, [T, Ke] int32 slots, [T] int32 lengths)``.
ExtraSpan = tuple[TokenCache, torch.Tensor, torch.Tensor]


def _extra_span(
    extra: TokenCache | None, extra_indices: torch.Tensor | None, extra_lengths: torch.Tensor | None
) -> ExtraSpan | None:
    """The compressed keys as one triple, None on a window-only layer (``AttentionCall.of``
    refuses a partial triple)."""
    if extra is None or extra_indices is None or extra_lengths is None:
        return None
    return extra, extra_indices, extra_lengths


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One call of the sparse-attention op, checked once when made (:meth:`of`, the op's
    checks); the op's entry point (``table.sparse_attention_with_sink``) and every variant
    take one.

    Attributes
    ----------
    q : ``[T, H, D]`` float32 or bfloat16, already normed and roped.
    window : this layer's window cache (dense or fp8), addressed by window slot.
    swa_indices : ``[T, Ws]`` int32 window slots (-1 = none).
    swa_lengths : ``[T]`` int32 valid leading columns of ``swa_indices``.
    extra : a compressed layer's keys (:data:`ExtraSpan`: its c4 or c128 cache, ``[T, Ke]``
        int32 slots, -1 = none: the c4 top-k or the c128 entries, and ``[T]`` int32 valid
        leading columns); None on a window-only layer (:meth:`of` takes the three apart).
    sink : ``[H]`` float32 finite per-head sink logit (adds ``exp(sink)`` to the denominator).
    softmax_scale : logit scale, ``head_dim ** -0.5``.
    rows_per_group : how many consecutive rows mostly share keys (the rows of one verify or
        draft-extend request; 1 for decode). The Triton path packs up to that many rows into
        one program (:func:`group_rows`) and gathers their union of keys once
        (``kernels/attention/key_union.py``); the result does not depend on it.
    """

    q: torch.Tensor
    window: TokenCache
    swa_indices: torch.Tensor
    swa_lengths: torch.Tensor
    extra: ExtraSpan | None
    sink: torch.Tensor
    softmax_scale: float
    rows_per_group: int = 1

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        window: TokenCache,
        swa_indices: torch.Tensor,
        swa_lengths: torch.Tensor,
        extra: TokenCache | None,
        extra_indices: torch.Tensor | None,
        extra_lengths: torch.Tensor | None,
        sink: torch.Tensor,
        softmax_scale: float,
        *,
        rows_per_group: int = 1,
    ) -> AttentionCall:
        """The op's arguments as one checked call: ``BatchError`` / ``ContractError`` naming
        the first that does not fit (shapes, dtypes, devices, the slots' range on the CPU)."""
        if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16):
            raise BatchError(
                f"q has shape {tuple(q.shape)} and dtype {q.dtype}; expected [T, H, D] float32 or "
                "bfloat16"
            )
        rows, heads, dim = q.shape
        if sink.shape != (heads,) or sink.dtype != torch.float32:
            raise BatchError(
                f"sink has shape {tuple(sink.shape)} and dtype {sink.dtype}; expected [{heads}] "
                "float32 (one logit per head of q)"
            )
        if not (
            isinstance(softmax_scale, (int, float))
            and math.isfinite(softmax_scale)
            and softmax_scale > 0
        ):
            raise BatchError(f"softmax_scale={softmax_scale!r}; expected a finite positive float")
        extra_given = [p is not None for p in (extra, extra_indices, extra_lengths)]
        if any(extra_given) and not all(extra_given):
            raise BatchError(
                "extra, extra_indices and extra_lengths must all be given (compressed layer) or "
                f"all be None (window-only layer); got given={extra_given}"
            )
        spans = [("window", window, "swa_indices", swa_indices, "swa_lengths", swa_lengths)]
        extra_span = _extra_span(extra, extra_indices, extra_lengths)
        if extra_span is not None:
            ext, ext_indices, ext_lengths = extra_span
            spans.append(("extra", ext, "extra_indices", ext_indices, "extra_lengths", ext_lengths))
        tensors = {"sink": sink}
        for cache_name, cache, idx_name, idx, len_name, lengths in spans:
            if cache.dim != dim or cache.rope_dim != window.rope_dim:
                raise BatchError(
                    f"the {cache_name} cache holds head_dim {cache.dim} (rope_dim "
                    f"{cache.rope_dim}); q has D={dim} and the window cache rope_dim "
                    f"{window.rope_dim}"
                )
            tensors[f"{cache_name} cache"] = cache.storage
            if idx.dim() != 2 or idx.dtype != torch.int32 or idx.shape[1] == 0:
                raise BatchError(
                    f"{idx_name} has shape {tuple(idx.shape)} and dtype {idx.dtype}; expected "
                    "[T, width] int32 with width >= 1"
                )
            if lengths.shape != (idx.shape[0],) or lengths.dtype != torch.int32:
                raise BatchError(
                    f"{len_name} has shape {tuple(lengths.shape)} and dtype {lengths.dtype}; "
                    f"expected [{idx.shape[0]}] int32 (one length per row of {idx_name})"
                )
            if idx.shape[0] != rows:
                raise ContractError(
                    f"{idx_name} has {idx.shape[0]} rows but q has T={rows}: the attention "
                    "metadata was planned for another batch (plan after the batch is padded)"
                )
            tensors[idx_name] = idx
            tensors[len_name] = lengths
        for name, tensor in tensors.items():
            if tensor.device != q.device:
                raise BatchError(f"{name} is on {tensor.device}; q is on {q.device}")
        for _, cache, idx_name, idx, _, _ in spans:
            cache.check_slots(idx, idx_name)  # slot range, checked on the CPU only (no GPU sync)
        return cls(
            q, window, swa_indices, swa_lengths, extra_span, sink, softmax_scale, rows_per_group
        )

    @property
    def extra_cache(self) -> TokenCache | None:
        """The compressed layer's cache (None on a window-only layer)."""
        return None if self.extra is None else self.extra[0]

    def parts(
        self,
    ) -> tuple[
        torch.Tensor, TokenCache, torch.Tensor, torch.Tensor, ExtraSpan | None, torch.Tensor, float
    ]:
        """``(q, window, swa_indices, swa_lengths, extra, sink, softmax_scale)``."""
        return (
            self.q,
            self.window,
            self.swa_indices,
            self.swa_lengths,
            self.extra,
            self.sink,
            self.softmax_scale,
        )


# ------------------------------------------------------------------- splits and groups
def _block_h(heads: int) -> int:
    """Heads per program: all of them up to 64 (one wgmma M tile), at least 16 (the smallest
    ``tl.dot`` M)."""
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(heads)))


def default_num_splits(rows: int, heads: int, width: int, block_n: int, sms: int) -> int:
    """Key splits per program row (a query row, or a group of rows taken together) so that
    the grid fills the SMs in one wave.

    ``rows * cdiv(heads, BLOCK_H)`` programs share ``sms`` SMs (one program per SM: its
    registers fill one); each row gets ``sms // programs`` splits (a partial second wave would
    cost as much as a full one), at most ``cdiv(width, block_n)`` (a key block per split) and
    at most ``MAX_SPLITS``. One split when the rows alone fill the GPU: no partials, no merge.
    """
    programs = max(1, rows * triton.cdiv(heads, _block_h(heads)))  # rows may be 0
    return max(1, min(sms // programs, triton.cdiv(width, block_n), MAX_SPLITS))


def checked_num_splits(splits: int) -> int:
    """``splits`` when it is a key-split count the kernels take, else ``BatchError``."""
    if not 1 <= splits <= MAX_SPLITS:
        raise BatchError(f"num_splits={splits}; expected 1 ... {MAX_SPLITS}")
    return splits


#: Split count pinned by :func:`force_num_splits` (tests run every schedule with splits > 1).
_forced_splits: list[int] = []


@contextlib.contextmanager
def force_num_splits(splits: int) -> Iterator[None]:
    """Inside the block every Triton launch without an explicit ``num_splits`` uses ``splits``,
    on any device (splits past a row's keys are empty and merge as nothing)."""
    _forced_splits.append(checked_num_splits(splits))
    try:
        yield
    finally:
        _forced_splits.pop()


def launch_num_splits(
    num_splits: int | None, rows: int, heads: int, width: int, block_n: int, device: torch.device
) -> int:
    """The key splits of a launch: ``num_splits`` (checked by :func:`checked_num_splits`), or
    for None the forced count, else :func:`default_num_splits` on a GPU, else 1 (the
    interpreter runs programs one by one)."""
    if num_splits is not None:
        return checked_num_splits(num_splits)
    if _forced_splits:
        return _forced_splits[-1]
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return default_num_splits(rows, heads, width, block_n, sms)


def group_rows(heads: int, rows_per_group: int) -> int:
    """Rows a program takes together (``G``): as many of the ``rows_per_group`` consecutive
    rows as fill the 64 lines of one wgmma M tile with their heads (``64 // BLOCK_H``, at most
    ``key_union.MAX_GROUP``); 1 where the heads alone fill it (H = 64) or the tile would be
    below the 16 lines of the smallest dot."""
    block_h = triton.next_power_of_2(heads)
    group = min(rows_per_group, MAX_BLOCK_H // block_h, MAX_GROUP)
    return group if group > 1 and block_h * triton.next_power_of_2(group) >= 16 else 1


def program_heads(heads: int, group: int) -> int:
    """Heads a program takes (``BLOCK_H``) when it takes ``group`` rows: all of them, rounded
    up to a power of two, for a group (``G * BLOCK_H`` fills the M tile); else
    :func:`_block_h`."""
    return _block_h(heads) if group == 1 else triton.next_power_of_2(heads)


# ------------------------------------------------------------------------------ key lists
@dataclasses.dataclass(frozen=True)
class KeySpans:
    """The key lists of one attention launch, as every kernel of the op walks them (one key
    loop over a program row's window columns, then its extra columns). ``P`` program rows:
    the query rows (``group`` 1: the caller's lists, unit-stride along columns) or groups of
    ``group`` rows (their union lists, ``kernels/attention/key_union.py``)."""

    #: The extra cache; the window's on a window-only layer (any valid pointer: never read).
    ext_cache: TokenCache
    #: ``[P, Ws]`` int32 window slots (a group: union slots, row bits ``bits_offset`` on).
    swa_indices: torch.Tensor
    #: ``[P]`` int32 valid leading columns of ``swa_indices``.
    swa_lengths: torch.Tensor
    #: ``[P, Ke]`` int32 extra slots, as ``swa_indices`` (the window's when not ``has_extra``).
    ext_indices: torch.Tensor
    #: ``[P]`` int32 valid leading columns of ``ext_indices``.
    ext_lengths: torch.Tensor
    has_extra: bool
    #: Rows a program takes (:func:`group_rows`).
    group: int
    #: Elements from a union slot to its row bits (``key_union``'s table[1]); 0 for no group.
    bits_offset: int
    #: Heads a program takes (:func:`program_heads`).
    block_h: int

    @property
    def programs(self) -> int:
        """``P``: program rows."""
        return self.swa_indices.shape[0]

    @property
    def width(self) -> int:
        """Index columns a program row walks at most (window plus extra)."""
        return self.swa_indices.shape[1] + (self.ext_indices.shape[1] if self.has_extra else 0)


def key_spans(
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra_span: ExtraSpan | None,
    heads: int,
    rows_per_group: int = 1,
) -> KeySpans:
    """The :class:`KeySpans` of inputs ``AttentionCall.of`` accepted (``extra_span``: what it
    returned), packing up to
    ``rows_per_group`` rows a program (:func:`group_rows`; the union lists cost a
    ``key_union`` launch). ``BatchError`` for a ``rows_per_group`` below 1 or a cache whose
    storage is not contiguous (the kernels address rows and pages from its base)."""
    if not isinstance(rows_per_group, int) or rows_per_group < 1:
        raise BatchError(f"rows_per_group={rows_per_group!r}; expected an int >= 1")
    ext_cache, ext_indices, ext_lengths = extra_span or (window, swa_indices, swa_lengths)
    for name, cache in (("window", window), ("extra", ext_cache)):
        if not cache.storage.is_contiguous():
            raise BatchError(
                f"the {name} cache storage has strides {cache.storage.stride()}; the kernel "
                "needs it contiguous"
            )
    group = group_rows(heads, rows_per_group)
    if group == 1:
        # The kernels step index columns and lengths with unit stride (no-ops when so).
        win = (swa_indices.contiguous(), swa_lengths.contiguous())
        ext = (ext_indices.contiguous(), ext_lengths.contiguous())
        bits_offset = 0
    else:
        union = key_union(
            swa_indices, swa_lengths, extra_span and ext_indices, extra_span and ext_lengths, group
        )
        slots = union.table[0]
        win = (slots[:, : union.extra_column], union.lengths[0])
        ext = (slots[:, union.extra_column :], union.lengths[1]) if extra_span else win
        bits_offset = union.table.stride(0)  # table[1] (row bits) beside table[0] (slots)
    return KeySpans(
        ext_cache,
        *win,
        *ext,
        extra_span is not None,
        group,
        bits_offset,
        program_heads(heads, group),
    )


# ------------------------------------------------------------------- dtypes and tolerance
def output_dtype(q: torch.Tensor) -> torch.dtype:
    """The op's output dtype for queries ``q``: bf16 for bf16 queries on a GPU (the caller's
    dtype, half the bytes the fp32 output cost: 23 % of an fp8 decode's roofline bytes),
    else float32 (the interpreter and the torch path, exact to the fp32 reference)."""
    return torch.bfloat16 if q.is_cuda and q.dtype == torch.bfloat16 else torch.float32


def dot_operand_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype of the attention dots' operands for tensors on ``device``: bf16 on a GPU
    (tensor cores, fp32 accumulation), fp32 in the interpreter and the torch path."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


#: Output error per unit roundoff of the dot operands (q, keys and weights each rounded once),
#: against the fp32 reference: TF32 operands (roundoff 2^-11) gave 2.0-2.4e-3 on the tiny
#: model, about 5 roundoffs; bf16 rounding emulated on random rows (tests) reaches about 6.
#: 12 leaves a 2x margin.
ROUNDOFFS_PER_OUTPUT = 12
#: Floor of the tolerance: fp32 sums in another order.
FP32_ATOL = 2e-5


def attention_tolerance(device: torch.device | str) -> float:
    """Absolute tolerance of this op's output against an fp32 reference (outputs of order 1),
    derived from :func:`dot_operand_dtype`: bf16 (roundoff 2^-8) gives 12 * 2^-8 = 0.047."""
    roundoff = torch.finfo(dot_operand_dtype(device)).eps / 2
    return max(FP32_ATOL, ROUNDOFFS_PER_OUTPUT * roundoff)


# ---------------------------------------------------------------------- fp8 kernels
def pipelined_unsupported_reason(
    window: TokenCache, extra: TokenCache | None, dim: int
) -> str | None:
    """Why the pipelined kernel cannot take these caches (None when it can): fp8 caches only, a
    power-of-two head dim of 128 ... 512 whose last 64 channels are rope (the ws kernel's
    requirements of fp8 caches too)."""
    for name, cache in (("window", window), ("extra", extra)):
        if cache is not None and cache.fmt != "fp8":
            return f"the {name} cache is {cache.fmt}; the pipelined kernel reads fp8 caches"
    if dim not in (128, 256, 512) or window.rope_dim != ROPE_DIM:
        return (
            f"head_dim {dim} with rope_dim {window.rope_dim}; the pipelined kernel takes head_dim "
            f"128, 256 or 512 with rope_dim {ROPE_DIM}"
        )
    return None


def page_geometry(cache: TokenCache) -> tuple[int, int, int]:
    """``(page_shift, page_bytes, scale_region)`` of an fp8 token cache."""
    layout = cache.layout
    assert layout is not None and layout.page_tokens & (layout.page_tokens - 1) == 0
    return layout.page_tokens.bit_length() - 1, layout.page_bytes, layout.scale_base
