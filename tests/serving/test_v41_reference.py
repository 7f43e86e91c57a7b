"""The DeepSeek-V4.1 model reference (``testing/reference/v41_model.py``): what a layer reads of
the layers before it, on a small V4.1 configuration of every role (a c2 kv source and a layer
sharing it, a c1 kv source that is the candidate source, an index source reusing its keys, a
candidate consumer, a layer reusing the last selection).

The checks hold by the definitions, independently of the fp4 and top-k details: with enough
selection every layer attends to every visible entry of its kv source; a layer that is not an
index source attends with the selection of the last index source of its ratio; a candidate
consumer selects only among the candidate blocks and, when the blocks cover every entry,
exactly as the full top-k would.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError, ContractError
from dsv4_backend.testing.reference import (
    low_ratio_entries,
    reference_attention,
    rope_for_ratio,
)
from dsv4_backend.testing.reference.v41_model import V41LayerInputs, reference_v41
from dsv4_backend.testing.simulation.v41 import (
    TINY_V41_RATIOS,
    TINY_V41_SOURCES,
    tiny_v41,
    v41_inputs,
)

S = 150  # past the window (128) so windows and entries both matter
RATIOS, SOURCES, config = TINY_V41_RATIOS, TINY_V41_SOURCES, tiny_v41


def inputs(cfg: DSV4AttentionConfig, seed: int = 0) -> list[V41LayerInputs]:
    return v41_inputs(cfg, S, seed)


def test_with_enough_selection_every_layer_sees_every_visible_entry() -> None:
    """``index_topk`` and the candidate blocks past every row's visible entries: each
    low-ratio layer's output is the attention over its window and all visible entries of its
    kv source."""
    cfg = config(index_topk=S, v41=dataclasses.replace(SOURCES, candidate_topk_blocks=S))
    layers = inputs(cfg)
    result = reference_v41(cfg, layers)
    for layer, ratio in enumerate(cfg.compress_ratios):
        given = layers[layer]
        if ratio == 0:
            want = reference_attention(cfg, 0, given.q, given.window_kv, None, None, given.sink)
        else:
            source = layers[cfg.kv_source_of(layer)]
            entries = low_ratio_entries(
                source.kv_proj, source.score_proj, source.norm_weight, ratio,
                rope_for_ratio(cfg, ratio), cfg.rms_norm_eps,
            )  # fmt: skip
            want = reference_attention(
                cfg, ratio, given.q, given.window_kv, entries, None, given.sink
            )
        torch.testing.assert_close(result.outputs[layer], want, rtol=0, atol=1e-6)


def test_selections_flow_from_the_index_sources() -> None:
    """A layer that is not an index source attends with the last index source's selection of
    its ratio; the candidate consumer selects only among the candidate source's blocks; a
    selection never holds an entry a row cannot see."""
    cfg = config()
    result = reference_v41(cfg, inputs(cfg))
    sel = result.selections
    assert sel[0] is None
    assert sel[2] is sel[1] and sel[4] is sel[3]  # shared: the same selection
    assert not torch.equal(sel[5], sel[3])  # the consumer selects anew
    positions = torch.arange(S)
    for layer in (1, 3, 5):
        visible = (positions + 1) // RATIOS[layer]
        chosen = sel[layer]
        assert ((chosen < visible[:, None]) | (chosen == -1)).all()
    # Two candidate blocks of 8 entries: a consumer row's entries lie in at most two blocks.
    for t in range(S):
        row = sel[5][t][sel[5][t] >= 0]
        assert (row // 8).unique().numel() <= 2


def test_candidate_blocks_covering_every_entry_change_nothing() -> None:
    """Blocks enough for every entry: the consumer's selection is the full top-k of its own
    scores, i.e. what a layer without candidates would select."""
    covering = dataclasses.replace(SOURCES, candidate_topk_blocks=S)
    with_blocks = reference_v41(cfg := config(v41=covering), layers := inputs(cfg))
    no_candidates = dataclasses.replace(SOURCES, candidate_source_layer=-1)
    without = reference_v41(config(v41=no_candidates), layers)
    assert torch.equal(with_blocks.selections[5], without.selections[5])
    torch.testing.assert_close(with_blocks.outputs[5], without.outputs[5], rtol=0, atol=0)


def test_missing_role_inputs_are_refused() -> None:
    cfg = config()
    layers = inputs(cfg)
    layers[3] = dataclasses.replace(layers[3], wk=None)
    with pytest.raises(ContractError, match=r"layer 3 needs \['wk'\]"):
        reference_v41(cfg, layers)
    with pytest.raises(ConfigError, match="one input per layer"):
        reference_v41(cfg, layers[:-1])
