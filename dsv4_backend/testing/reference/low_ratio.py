"""DeepSeek-V4.1's low-ratio compressors (ratio 1 and 2, on kv-source layers) and its indexer,
from the formulas (docs/design.md §8).

Per token ``t`` of a request (positions ``0 ... S-1``) the compressor projects ``kv_t = wkv x_t``
and, for ratio 2, ``score_t = wgate x_t`` (``D`` wide each, float32; no positional bias, no
overlap):

* ratio 1: entry ``t`` is token ``t``'s ``kv_t``;
* ratio 2: entry ``w`` pools the pair ``(2w, 2w + 1)``: a per-channel softmax over the pair's
  scores, in float32, weighting their ``kv``;

then ``RMSNorm(bf16(pooled))`` (statistics and weight in float32, the result rounded to bf16,
the module's dtype), RoPE at the entry's first position ``w * ratio`` with the compressed
layers' YaRN table (rounded to bf16), and fp4 fake quantisation with one e4m3 scale per 16
values (``fp4.fake_quant_e4m3``). A row at position ``p`` sees entries ``0 ... (p + 1) //
ratio - 1`` (a ratio-1 row its own token's entry too).

The indexer: a kv source's index keys are ``fp4(rope(k_norm(wk latent)))`` of its entries'
latents before RoPE (ue8m0 scales per 32), an index source's queries ``fp4(rope(wq_b q_lora))``
``[T, HI, DI]`` and head weights ``weights_proj(x) DI^-1/2 HI^-1/2``; a row's score of an entry
is ``sum_h w_h relu(q_h . k)``. The full top-k keeps the ``index_topk`` best visible entries;
the candidate source also publishes each row's best blocks of ``candidate_block_size`` entries
(a block's key: its best score; the newest block always kept), among whose entries its
candidate consumers take their top-k.
"""

from __future__ import annotations

import torch

from dsv4_backend.errors import ContractError
from dsv4_backend.testing.reference.fp4 import fake_quant_e4m3, fake_quant_ue8m0
from dsv4_backend.testing.reference.norm import rms_norm
from dsv4_backend.testing.reference.rope import RopeParams, apply_rope


def pool_pairs(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Ratio 2: ``[S, D]`` kv and scores -> ``[S // 2, D]`` float32, each pair pooled by a
    per-channel softmax of its two scores."""
    n = kv.shape[0] // 2
    kv2, score2 = (
        kv[: 2 * n].float().unflatten(0, (n, 2)),
        score[: 2 * n].float().unflatten(0, (n, 2)),
    )
    return (torch.softmax(score2, dim=1) * kv2).sum(dim=1)


def low_ratio_latents(
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor | None,
    norm_weight: torch.Tensor,
    ratio: int,
    eps: float,
) -> torch.Tensor:
    """Every complete entry's latent before RoPE, ``RMSNorm(bf16(pooled))`` rounded to bf16
    (module docstring; what the index keys project): ``[S // ratio, D]`` float32.

    ``kv_proj``: ``[S, D]`` float32 ``wkv x`` of the request's tokens; ``score_proj``: ``[S,
    D]`` float32 ``wgate x`` (ratio 2), None for ratio 1; ``norm_weight`` ``[D]`` and ``eps``:
    the compressor's RMSNorm.
    """
    if ratio not in (1, 2) or (score_proj is None) != (ratio == 1):
        raise ContractError(
            f"ratio={ratio} with score_proj {'None' if score_proj is None else 'given'}; "
            "expected ratio 1 without scores or ratio 2 with them"
        )
    pooled = kv_proj.float() if score_proj is None else pool_pairs(kv_proj, score_proj)
    return rms_norm(pooled.bfloat16(), norm_weight, eps).bfloat16().float()


def low_ratio_entries(
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor | None,
    norm_weight: torch.Tensor,
    ratio: int,
    rope: RopeParams,
    eps: float,
) -> torch.Tensor:
    """Every complete entry of one request (module docstring): the latents
    (:func:`low_ratio_latents`, the same arguments) roped at ``w * ratio`` with ``rope`` (the
    compressed layers' RoPE, ``rope_for_ratio(config, ratio)``) and rounded to bf16, then fp4
    with e4m3 scales. Returns ``[S // ratio, D]`` float32."""
    latents = low_ratio_latents(kv_proj, score_proj, norm_weight, ratio, eps)
    positions = torch.arange(latents.shape[0], device=latents.device) * ratio
    cos, sin = rope.cos_sin(positions)
    return fake_quant_e4m3(apply_rope(latents, cos, sin).bfloat16())


# ----------------------------------------------------------------------------- the indexer
def index_keys(
    k_proj: torch.Tensor,
    k_norm_weight: torch.Tensor,
    rope: RopeParams,
    positions: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The index keys a kv-source layer writes for its entries.

    ``k_proj``: ``[n, DI]`` the entries' ``wk`` projections of their latents before RoPE (bf16
    values); ``positions``: ``[n]`` each entry's first position. ``RMSNorm`` (``k_norm``)
    rounded to bf16, RoPE on the trailing dims rounded to bf16, then fp4 with one ue8m0 scale
    per 32 values (``fp4.fake_quant_ue8m0``). Returns ``[n, DI]`` float32.
    """
    normed = rms_norm(k_proj.bfloat16(), k_norm_weight, eps).bfloat16()
    cos, sin = rope.cos_sin(positions)
    return fake_quant_ue8m0(apply_rope(normed, cos, sin).bfloat16())


def index_queries(q_proj: torch.Tensor, rope: RopeParams, positions: torch.Tensor) -> torch.Tensor:
    """``[T, HI, DI]`` indexer queries from ``wq_b(q_lora)`` (bf16 values) at the rows'
    ``positions``: RoPE on the trailing dims rounded to bf16, then fp4 with one ue8m0 scale per
    32 values. Returns float32."""
    cos, sin = rope.cos_sin(positions)
    return fake_quant_ue8m0(apply_rope(q_proj.bfloat16(), cos, sin).bfloat16())


def index_head_weights(raw: torch.Tensor, index_head_dim: int) -> torch.Tensor:
    """``[T, HI]`` float32 head weights: ``weights_proj(x)`` times ``DI^-1/2 * HI^-1/2``."""
    return raw.float() * (index_head_dim**-0.5 * raw.shape[-1] ** -0.5)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[T, n]`` float32 ``sum_h w_h relu(q_h . k)``: queries ``[T, HI, DI]``, keys ``[n, DI]``,
    weights ``[T, HI]``."""
    dots = torch.einsum("thd,nd->thn", q.float(), keys.float())
    return (dots.relu() * weights.float()[..., None]).sum(dim=1)


def select_entries(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The full top-k: per row the ``k`` best of its ``visible[t]`` first entries (by score;
    equal scores: the lower entry id), in that order, ``-1`` after a row's last. ``scores``
    ``[T, n]``, ``visible`` ``[T]`` int; returns ``[T, k]`` int64."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int64)
    for t in range(scores.shape[0]):
        count = int(visible[t])
        order = sorted(range(count), key=lambda e: (-float(scores[t, e]), e))[:k]
        out[t, : len(order)] = torch.tensor(order, dtype=torch.int64)
    return out


def candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, num_blocks: int
) -> list[list[int]]:
    """What the candidate source publishes per row: its ``num_blocks`` best blocks of
    ``block_size`` consecutive entries among the row's ``visible[t]`` first (a block's key: the
    largest score of its visible entries; equal keys: the lower block), the newest block (the
    one holding the row's last visible entry) always among them. Block ids, best first."""
    out = []
    for t in range(scores.shape[0]):
        count = int(visible[t])
        blocks = -(-count // block_size)
        keys = [
            float(scores[t, b * block_size : min(count, (b + 1) * block_size)].max())
            for b in range(blocks)
        ]
        newest = [blocks - 1] if blocks else []
        rest = sorted(range(blocks - 1), key=lambda b: (-keys[b], b))
        out.append(newest + rest[: max(num_blocks - 1, 0)])
    return out


def select_from_candidates(
    scores: torch.Tensor, visible: torch.Tensor, blocks: list[list[int]], block_size: int, k: int
) -> torch.Tensor:
    """A candidate consumer's top-k: per row the ``k`` best of the visible entries of its
    candidate ``blocks`` (``candidate_blocks`` of the same row), as ``select_entries`` orders
    them. ``[T, k]`` int64, ``-1`` after a row's last."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int64)
    for t in range(scores.shape[0]):
        count = int(visible[t])
        entries = [
            e for b in blocks[t] for e in range(b * block_size, min(count, (b + 1) * block_size))
        ]
        order = sorted(entries, key=lambda e: (-float(scores[t, e]), e))[:k]
        out[t, : len(order)] = torch.tensor(order, dtype=torch.int64)
    return out
