"""FP8 byte layouts of the DeepSeek-V4 caches (sglang's ``DeepSeekV4TokenToKVPool``, layout V4).

Token caches (window, c4, c128), one page = ``PT`` tokens::

    [PT x TB] data region: per token NOPE e4m3 bytes, then ROPE bf16 values (TB = NOPE + 2*ROPE)
    [PT x 8]  scale region: per token NOPE/64 ue8m0 exponents, zero padding to 8 bytes
    zero padding up to a multiple of TB                  (Flash: TB 576, 584 B per token)

Indexer key cache (c4 layers), one page = 64 entries::

    [64 x DI] e4m3 bytes, then [64 x 4] bytes of fp32 scales     (132 B per entry for DI 128)

Quantisation (exact, so the torch and Triton encoders produce identical bytes):

* token caches, per 64-channel group: ``scale = 2^ceil(log2(amax / 448))`` computed exactly from
  the bits of ``amax`` (no float log/div), stored as the biased exponent ``e = log2(scale) + 127``
  (ue8m0), clamped to ``e >= 0``; ``amax == 0`` stores ``e = 127``. Values are
  ``e4m3(x * 2^(127 - e))`` (multiplication by a power of two is exact).
* indexer: ``scale = amax / 448`` (1.0 when ``amax == 0``), values ``e4m3(x / scale)`` with
  correctly rounded fp32 division on both paths.
* e4m3 is ``torch.float8_e4m3fn``: round to nearest even, saturate to +-448, no infinities.

Error bound: a value ``v = x / scale`` with ``|v| >= 2^-6`` (e4m3 normal) is rounded to 3
mantissa bits, so ``|v - e4m3(v)| <= 2^-4 * 2^floor(log2|v|)``; below that the absolute error is
at most ``2^-10`` (half the smallest subnormal, ``2^-9``). Dequantising multiplies by the scale.

The ``@triton.jit`` helpers at the bottom are the device-side API other kernels import (see
``.notes/cache-api.md``). They decode bits arithmetically, which is exact on GPUs and in the
Triton interpreter alike (the interpreter has no fp8 and truncates bf16 conversions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4_backend.errors import BatchError, ConfigError

E4M3_MAX = 448.0
#: Nope channels sharing one ue8m0 scale.
SCALE_GROUP = 64
#: Scale bytes per token in a token-cache page (7 scales + 1 pad byte for Flash).
SCALE_BYTES_PER_TOKEN = 8
#: Entries per indexer-cache page (the c4 entries of one 256-token full page).
INDEXER_PAGE_TOKENS = 64
#: Bytes of one indexer scale (fp32).
INDEXER_SCALE_BYTES = 4


# --------------------------------------------------------------------------- torch bit helpers
def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``v`` (any shape) -> e4m3fn bit patterns (uint8, same shape); saturates to +-448."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bit patterns (any shape) -> fp32 values (0x7F / 0xFF decode to NaN)."""
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Biased exponent (int32) of ``2^ceil(log2(amax / 448))`` for fp32 ``amax >= 0``.

    448 = 1.75 * 2^8, so for ``amax = m * 2^E`` (m in [1, 2)) the exponent is ``E - 8``, plus one
    when ``m > 1.75``. Clamped to ``[0, 255)``; ``amax == 0`` gives 127 (scale 1).
    """
    bits = amax.float().contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    e = biased - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = e.clamp(min=0)
    return torch.where(amax == 0, torch.full_like(e, 127), e)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """``2^(biased - 127)`` as fp32 for int32 ``biased`` in [0, 254] (0 gives 2^-127)."""
    bits = torch.where(biased > 0, biased << 23, torch.full_like(biased, 0x400000))
    return bits.view(torch.float32)


def bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[N, R]`` float -> ``[N, 2R]`` uint8: bf16 values (round to nearest even), little endian."""
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------ layouts
class _PagedBytes:
    """Slot addressing shared by both layouts: ``page = slot // page_tokens``,
    ``t = slot % page_tokens``; token t's data at ``t * token_bytes`` of its page, its scales at
    ``scale_base + t * scale_bytes``. Storage is ``[num_pages, page_bytes]`` uint8."""

    page_tokens: int
    token_bytes: int
    scale_bytes: int
    scale_base: int
    page_bytes: int

    def num_pages(self, num_slots: int) -> int:
        return -(-num_slots // self.page_tokens)

    def data_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 byte offsets (into the flat storage) of each slot's data; same shape as slots."""
        slots = slots.long()
        page, t = slots // self.page_tokens, slots % self.page_tokens
        return page * self.page_bytes + t * self.token_bytes

    def scale_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 byte offsets (into the flat storage) of each slot's scale bytes."""
        slots = slots.long()
        page, t = slots // self.page_tokens, slots % self.page_tokens
        return page * self.page_bytes + self.scale_base + t * self.scale_bytes

    def read_tokens(
        self, storage: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bytes of ``slots`` ``[N]`` (all valid) from ``storage``.

        Returns ``(data [N, token_bytes], scales [N, scale_bytes])`` uint8.
        """
        flat = storage.view(-1)
        data = flat[self.data_offsets(slots)[:, None] + _arange(self.token_bytes, storage)]
        scales = flat[self.scale_offsets(slots)[:, None] + _arange(self.scale_bytes, storage)]
        return data, scales

    def write_tokens(
        self, storage: torch.Tensor, slots: torch.Tensor, data: torch.Tensor, scales: torch.Tensor
    ) -> None:
        """Write packed tokens (as ``pack_tokens`` returns them) at valid ``slots`` ``[N]``."""
        flat = storage.view(-1)
        flat[self.data_offsets(slots)[:, None] + _arange(self.token_bytes, storage)] = data
        flat[self.scale_offsets(slots)[:, None] + _arange(self.scale_bytes, storage)] = scales


@dataclass(frozen=True)
class Fp8TokenLayout(_PagedBytes):
    """Byte layout of an fp8 token cache page: ``nope_dim`` e4m3 + ``rope_dim`` bf16 per token.

    ``nope_dim`` must be a positive multiple of 64 with at most 8 groups (one scale byte each).
    """

    nope_dim: int
    rope_dim: int
    page_tokens: int

    def __post_init__(self) -> None:
        if self.nope_dim <= 0 or self.nope_dim % SCALE_GROUP:
            raise ConfigError(
                f"nope_dim={self.nope_dim}; the fp8 token format needs a positive multiple of "
                f"{SCALE_GROUP} (one ue8m0 scale per {SCALE_GROUP} channels)"
            )
        if self.num_scales > SCALE_BYTES_PER_TOKEN:
            raise ConfigError(
                f"nope_dim={self.nope_dim} needs {self.num_scales} scales; a token has "
                f"{SCALE_BYTES_PER_TOKEN} scale bytes (nope_dim <= {8 * SCALE_GROUP})"
            )
        if self.rope_dim < 0 or self.page_tokens <= 0:
            raise ConfigError(
                f"rope_dim={self.rope_dim}, page_tokens={self.page_tokens}; expected "
                "rope_dim >= 0 and page_tokens > 0"
            )

    @property
    def head_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def num_scales(self) -> int:
        return self.nope_dim // SCALE_GROUP

    @property
    def token_bytes(self) -> int:
        """Data bytes per token: ``nope_dim + 2 * rope_dim`` (576 for Flash)."""
        return self.nope_dim + 2 * self.rope_dim

    @property
    def scale_bytes(self) -> int:
        return SCALE_BYTES_PER_TOKEN

    @property
    def bytes_per_token(self) -> int:
        """Data plus scale bytes per token, before page padding (584 for Flash)."""
        return self.token_bytes + SCALE_BYTES_PER_TOKEN

    @property
    def scale_base(self) -> int:
        """Byte offset of the scale region inside a page."""
        return self.page_tokens * self.token_bytes

    @property
    def page_bytes(self) -> int:
        """``page_tokens * bytes_per_token`` rounded up to a multiple of ``token_bytes``."""
        return -(-self.page_tokens * self.bytes_per_token // self.token_bytes) * self.token_bytes

    def pack_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise ``x`` ``[N, head_dim]`` (any float dtype).

        Returns ``data`` ``[N, token_bytes]`` uint8 (e4m3 nope bytes, then bf16 rope bytes) and
        ``scales`` ``[N, 8]`` uint8 (ue8m0 exponents, zero padded).
        """
        _check_width(x, self.head_dim, "x")
        n = x.shape[0]
        groups = x[:, : self.nope_dim].float().reshape(n, self.num_scales, SCALE_GROUP)
        e = ue8m0_exponent(groups.abs().amax(dim=-1))  # [N, G]
        codes = e4m3_encode(groups * _pow2(254 - e)[..., None])
        data = torch.cat([codes.reshape(n, self.nope_dim), bf16_bytes(x[:, self.nope_dim :])], 1)
        scales = torch.zeros(n, SCALE_BYTES_PER_TOKEN, dtype=torch.uint8, device=x.device)
        scales[:, : self.num_scales] = e.to(torch.uint8)
        return data, scales

    def unpack_tokens(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack_tokens`: ``[N, token_bytes]``, ``[N, 8]`` uint8 -> ``[N, D]``
        fp32."""
        n = data.shape[0]
        codes = data[:, : self.nope_dim].reshape(n, self.num_scales, SCALE_GROUP)
        scale = _pow2(scales[:, : self.num_scales].to(torch.int32))
        nope = (e4m3_decode(codes) * scale[..., None]).reshape(n, self.nope_dim)
        rope = data[:, self.nope_dim :].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, rope], dim=1)


@dataclass(frozen=True)
class Fp8IndexerLayout(_PagedBytes):
    """Byte layout of an fp8 indexer-key page: ``page_tokens`` x ``dim`` e4m3, then fp32 scales."""

    dim: int
    page_tokens: int = INDEXER_PAGE_TOKENS

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 4 or self.page_tokens <= 0:
            raise ConfigError(
                f"dim={self.dim}, page_tokens={self.page_tokens}; expected a positive multiple "
                "of 4 (keeps the fp32 scales aligned) and page_tokens > 0"
            )

    @property
    def token_bytes(self) -> int:
        return self.dim

    @property
    def scale_bytes(self) -> int:
        return INDEXER_SCALE_BYTES

    @property
    def bytes_per_token(self) -> int:
        """132 for ``dim`` 128."""
        return self.dim + INDEXER_SCALE_BYTES

    @property
    def scale_base(self) -> int:
        return self.page_tokens * self.dim

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token

    def pack_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, dim]`` float -> ``(data [N, dim] uint8, scales [N, 4] uint8)``.

        ``scales`` holds the bytes of the fp32 scale.
        """
        _check_width(x, self.dim, "x")
        x = x.float()
        amax = x.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)
        return e4m3_encode(x / scale), scale.contiguous().view(torch.uint8)

    def unpack_tokens(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``[N, dim]``, ``[N, 4]`` uint8 -> ``[N, dim]`` fp32."""
        return e4m3_decode(data) * scales.contiguous().view(torch.float32)


def _arange(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(n, device=like.device)


def _check_width(x: torch.Tensor, width: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != width or not x.is_floating_point():
        raise BatchError(
            f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}; expected a float tensor "
            f"[N, {width}]"
        )


# ------------------------------------------------------------------- Triton device helpers
@triton.jit
def e4m3_to_fp32(code):
    """uint8 e4m3fn bit patterns (any shape) -> fp32; 0x7F/0xFF -> NaN, like torch."""
    c = code.to(tl.int32) & 0xFF
    sign = (c >> 7) & 1
    exp = (c >> 3) & 15
    man = c & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # man * 2^-9
    sub = tl.where(sign == 1, -sub, sub)
    val = tl.where(exp == 0, sub, normal)
    nan = tl.full(c.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where((c & 0x7F) == 0x7F, nan, val)


@triton.jit
def fp32_to_e4m3(v):
    """fp32 (any shape) -> uint8 e4m3fn bits: round to nearest even, saturate to +-448.

    Keeps the 24-bit significand ``m`` of ``|v| = m * 2^(e-23)`` and drops ``shift`` low bits:
    20 for e4m3 normals (e >= -6), more below (subnormals, step 2^-9); a carry into the next
    binade is absorbed by adding ``q`` to ``(e + 6) * 8``.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127
    m = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(14 - e, 20), 24)
    q = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.maximum(e + 6, 0) * 8 + q
    code = tl.where(e < -10, 0, tl.minimum(code, 126))
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN stays NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def ue8m0_exponent_of(amax):
    """Biased ue8m0 exponent (int32) of ``2^ceil(log2(amax / 448))``; see :func:`ue8m0_exponent`."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.maximum(e, 0)
    return tl.where(amax == 0, 127, e)


@triton.jit
def pow2_of_biased(biased):
    """``2^(biased - 127)`` as fp32 for int32 ``biased`` in [0, 254] (0 -> 2^-127)."""
    return tl.where(biased > 0, biased << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(x):
    """fp32 -> bf16 bit patterns (uint16), round to nearest even (NaN/inf preserved)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).to(tl.uint16)


@triton.jit
def bf16_bits_to_fp32(h):
    """bf16 bit patterns (uint16) -> fp32 (exact)."""
    return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp8_token_addresses(
    slots,  # [BLOCK_N] int (slot ids; < 0 means no slot)
    mask_n,  # [BLOCK_N] bool
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """``(data_base, scale_base, valid)`` for token-cache slots: int64 byte offsets [BLOCK_N] of
    each token's data and scale bytes in the flat storage, and ``mask_n & (slots >= 0)``.
    Mirrors :meth:`Fp8TokenLayout.data_offsets` / :meth:`Fp8TokenLayout.scale_offsets`."""
    TOKEN_BYTES: tl.constexpr = NOPE_DIM + 2 * ROPE_DIM
    PAGE_BYTES: tl.constexpr = (
        (PAGE_TOKENS * (TOKEN_BYTES + 8) + TOKEN_BYTES - 1) // TOKEN_BYTES * TOKEN_BYTES
    )
    valid = mask_n & (slots >= 0)
    s = tl.where(valid, slots, 0).to(tl.int64)
    page_base = (s // PAGE_TOKENS) * PAGE_BYTES
    t = s % PAGE_TOKENS
    return page_base + t * TOKEN_BYTES, page_base + PAGE_TOKENS * TOKEN_BYTES + t * 8, valid


@triton.jit
def load_fp8_nope_block(
    cache_ptr,  # uint8 [num_pages, PAGE_BYTES] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 nope channel ids (>= NOPE_DIM -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Dequantised nope channels ``offs_d`` of tokens ``slots``: ``[BLOCK_N, BLOCK_D]`` fp32."""
    data_base, scale_base, valid = fp8_token_addresses(
        slots, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS
    )
    m = valid[:, None] & (offs_d < NOPE_DIM)[None, :]
    code = tl.load(cache_ptr + data_base[:, None] + offs_d[None, :], mask=m, other=0)
    e = tl.load(cache_ptr + scale_base[:, None] + (offs_d // 64)[None, :], mask=m, other=127)
    return e4m3_to_fp32(code) * pow2_of_biased(e.to(tl.int32))


@triton.jit
def load_bf16_rope_block(
    cache_ptr,  # uint8 [num_pages, PAGE_BYTES] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_r,  # [BLOCK_R] int32 rope channel ids 0 .. ROPE_DIM-1 (others -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """RoPE channels ``offs_r`` (counted from the first rope channel) as ``[BLOCK_N, BLOCK_R]``
    fp32, exact. Head channel ``NOPE_DIM + r`` is rope channel ``r``."""
    data_base, _, valid = fp8_token_addresses(slots, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS)
    m = valid[:, None] & ((offs_r >= 0) & (offs_r < ROPE_DIM))[None, :]
    # Rope bytes start at an even offset (page and token sizes are even), so 16-bit loads align.
    ptr = (cache_ptr + data_base[:, None] + NOPE_DIM + 2 * offs_r[None, :]).to(
        tl.pointer_type(tl.uint16)
    )
    return bf16_bits_to_fp32(tl.load(ptr, mask=m, other=0))


@triton.jit
def load_fp8_token_block(
    cache_ptr,  # uint8 [num_pages, PAGE_BYTES] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 head channel ids 0 .. NOPE_DIM+ROPE_DIM-1 (others -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Whole-head view: channels ``offs_d`` of ``[nope | rope]`` as ``[BLOCK_N, BLOCK_D]`` fp32."""
    nope = load_fp8_nope_block(cache_ptr, slots, offs_d, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS)
    rope = load_bf16_rope_block(
        cache_ptr, slots, offs_d - NOPE_DIM, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS
    )
    return nope + rope  # each is 0 where the other is defined


@triton.jit
def fp8_indexer_addresses(
    slots,  # [BLOCK_N] int (slot ids; < 0 means no slot)
    mask_n,  # [BLOCK_N] bool
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """``(data_base, scale_base, valid)`` for indexer slots, as :func:`fp8_token_addresses`."""
    PAGE_BYTES: tl.constexpr = PAGE_TOKENS * (DIM + 4)
    valid = mask_n & (slots >= 0)
    s = tl.where(valid, slots, 0).to(tl.int64)
    page_base = (s // PAGE_TOKENS) * PAGE_BYTES
    t = s % PAGE_TOKENS
    return page_base + t * DIM, page_base + PAGE_TOKENS * DIM + t * 4, valid


@triton.jit
def load_fp8_indexer_block(
    cache_ptr,  # uint8 [num_pages, PAGE_TOKENS * (DIM + 4)] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 channel ids (>= DIM -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Dequantised indexer keys ``[BLOCK_N, BLOCK_D]`` fp32 (``e4m3 * fp32 scale``)."""
    data_base, scale_base, valid = fp8_indexer_addresses(slots, mask_n, DIM, PAGE_TOKENS)
    m = valid[:, None] & (offs_d < DIM)[None, :]
    code = tl.load(cache_ptr + data_base[:, None] + offs_d[None, :], mask=m, other=0)
    scale = tl.load((cache_ptr + scale_base).to(tl.pointer_type(tl.float32)), mask=valid, other=0)
    return tl.where(m, e4m3_to_fp32(code) * scale[:, None], 0.0)


@triton.jit
def load_dense_block(
    cache_ptr,  # float [num_slots, DIM] (row stride stride_slot elements)
    stride_slot,  # elements between consecutive slots
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 channel ids (>= DIM -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    DIM: tl.constexpr,
):
    """Rows of a dense cache (token or indexer) as ``[BLOCK_N, BLOCK_D]`` fp32."""
    valid = mask_n & (slots >= 0)
    s = tl.where(valid, slots, 0).to(tl.int64)
    m = valid[:, None] & (offs_d < DIM)[None, :]
    x = tl.load(cache_ptr + s[:, None] * stride_slot + offs_d[None, :], mask=m, other=0.0)
    return x.to(tl.float32)


def triton_constexprs(layout: Fp8TokenLayout | Fp8IndexerLayout) -> dict[str, int]:
    """The layout constexprs the device helpers take, keyed by their parameter names."""
    if isinstance(layout, Fp8TokenLayout):
        return dict(
            NOPE_DIM=layout.nope_dim, ROPE_DIM=layout.rope_dim, PAGE_TOKENS=layout.page_tokens
        )
    return dict(DIM=layout.dim, PAGE_TOKENS=layout.page_tokens)
