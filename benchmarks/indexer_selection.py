"""The indexer's selections against the reference, on the CPU (torch path): ``exact`` (fp32
scores, the default), ``fp8`` (sglang's built-in: Hadamard-rotated, e4m3-quantised scores;
``DSV4_BACKEND_INDEXER_SELECTION=fp8``, the selection DeepGEMM's scores serve) and ``fp4``
(sglang's ``--enable-deepseek-v4-fp4-indexer``: Hadamard-rotated, fp4 keys and queries).

A random model with DeepSeek-V4-Flash's indexer (64 heads of 128, top-512) and one c4 layer
serves a prefill of ``--tokens`` tokens on each selection. For every row with more candidates
than the top-k it prints how many of the selected entries differ from the reference's exact
top-k (as a fraction of the top-k), and the c4 layer's largest output error against the
reference's full causal pass (which selects exactly).

    python benchmarks/indexer_selection.py [--tokens 2400] [--heads 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.dispatch import TORCH, force_path
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel


def measure(selection: str, tokens: int, heads: int, seed: int) -> tuple[float, float, float]:
    """``(mean differing fraction, worst differing fraction, max |out - reference|)``."""
    config = DSV4AttentionConfig(
        compress_ratios=(4,), num_heads=heads, head_dim=512, rope_dim=64, index_topk=512,
        index_n_heads=64, index_head_dim=128, indexer_selection=selection,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    pool = PagedRequestPool(config, [tokens], generator=generator)
    data = generator.get_state()  # both models draw the same layer data from here
    model = RandomModel(config, pool, generator=generator)
    exact_config = dataclasses.replace(config, indexer_selection="exact")
    twin = RandomModel(exact_config, pool, generator=torch.Generator().set_state(data))
    with force_path(TORCH):
        result = model.forward(pool.extend([0], [0], [tokens]))
        selected = result.metadata.compressed(4).page_indices
        reference = twin.forward(pool.extend([0], [0], [tokens])).metadata
    exact = reference.compressed(4).page_indices
    rows = (exact >= 0).sum(1) == config.index_topk  # rows whose top-k is a choice
    differing = []
    for got, want in zip(selected[rows].tolist(), exact[rows].tolist(), strict=True):
        differing.append(len(set(want) - set(got)) / config.index_topk)
    error = model.max_error(result)
    mean = sum(differing) / max(len(differing), 1)
    return mean, max(differing, default=0.0), error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2400)
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for selection in ("exact", "fp8", "fp4"):
        mean, worst, error = measure(selection, args.tokens, args.heads, args.seed)
        print(f"{selection:5}: {mean:.2%} of the top-512 differ from the exact one on average, "
              f"{worst:.2%} at worst; c4 layer max |out - reference| {error:.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
