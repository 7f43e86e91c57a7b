"""Input a hostile (or buggy) host may hand the backend: every case is refused with a typed error
naming the field and the value, and the stale-plan and write-slot cases write nothing.

Stale plans (``BatchTag``), write slots against ``req_to_token``, index ranges, the deferred
(device-side) verdict of those checks, and the smaller refusals (IDLE rows, layer ids, ``q``
widths, config field types).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dsv4_backend.compute import forward_layer
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ConfigError, ContractError
from dsv4_backend.hf_config import config_from_hf
from dsv4_backend.planning import checks, plan
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.draft import DSV4MultiStepDraftBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
HF = harness.tiny_hf_config(CONFIG)


@pytest.fixture
def host() -> SimpleNamespace:
    """A runner over three requests, its backend, the simulated model and a batch builder."""
    generator = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(CONFIG, [140, 270, 40], generator=generator)
    model = RandomModel(CONFIG, pool, generator=generator)
    runner = harness.mock_runner(pool, HF)
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    runner.attn_backend = backend
    return SimpleNamespace(
        pool=pool, model=model, runner=runner, backend=backend,
        sim=harness.SimulatedModel(model), batches=harness.BatchBuilder(pool),
    )  # fmt: skip


def snapshot(backend: DSV4AttentionBackend) -> list[torch.Tensor]:
    """Copies of every cache and ring the backend writes."""
    return [t.clone() for t in backend.state.named_tensors().values()]


def assert_nothing_written(backend: DSV4AttentionBackend, before: list[torch.Tensor]) -> None:
    after = snapshot(backend)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def run_all_layers(host: SimpleNamespace, step: harness.Step) -> None:
    for layer in range(len(CONFIG.compress_ratios)):
        host.sim.layer(host.backend, step, layer)


# ------------------------------------------------------------------------------ stale plans
def test_a_plan_reused_for_the_next_step_is_refused(host: SimpleNamespace) -> None:
    first = host.batches.decode([0, 1], [5, 9])
    host.backend.init_forward_metadata(first.batch)
    nxt = host.batches.decode([0, 1], [6, 10])  # the next step: same shapes
    before = snapshot(host.backend)
    with pytest.raises(ContractError) as refused:
        run_all_layers(host, nxt)
    message = str(refused.value)
    assert "store_cache (layer 0)" in message and "made for another batch" in message
    assert "planned with seq_lens_cpu=[5, 9] and the batch has [6, 10]" in message
    assert_nothing_written(host.backend, before)


def test_a_plan_reused_for_a_batch_without_host_lengths_is_refused_by_its_values(
    host: SimpleNamespace,
) -> None:
    """Without ``seq_lens_cpu`` (a batch without a CPU mirror) the device values decide."""
    first = host.batches.decode([0, 1], [5, 9])
    host.backend.init_forward_metadata(first.batch)
    nxt = host.batches.decode([0, 1], [6, 10])
    nxt.batch.seq_lens_cpu = None
    before = snapshot(host.backend)
    with pytest.raises(ContractError, match=r"seq_lens\[0\]=6 but the plan was made with "):
        run_all_layers(host, nxt)
    assert_nothing_written(host.backend, before)


def test_a_plan_for_the_same_requests_in_another_order_is_refused(host: SimpleNamespace) -> None:
    planned = host.batches.verify([0, 1], [126, 30], 4)
    host.backend.init_forward_metadata(planned.batch)
    reordered = host.batches.verify([1, 0], [30, 126], 4)
    before = snapshot(host.backend)
    reordered.batch.seq_lens_cpu = None  # the device values decide
    with pytest.raises(ContractError, match=r"another batch: req_pool_indices\[0\]=2 but"):
        run_all_layers(host, reordered)
    assert_nothing_written(host.backend, before)


@pytest.mark.parametrize("field", ["req_pool_indices", "seq_lens", "out_cache_loc"])
def test_batch_tensors_swapped_or_written_after_planning_are_refused(
    host: SimpleNamespace, field: str
) -> None:
    step = host.batches.decode([0, 1], [5, 9])
    host.backend.init_forward_metadata(step.batch)
    tensor = getattr(step.batch, field)
    tensor.copy_(tensor.flip(0))  # in place: the same object, another version
    before = snapshot(host.backend)
    with pytest.raises(ContractError, match=f"{field} was written in place since planning"):
        run_all_layers(host, step)
    setattr(step.batch, field, tensor.clone())  # rebound to a copy: its planned tensor changed
    with pytest.raises(ContractError, match=f"{field} was written in place since planning"):
        run_all_layers(host, step)
    assert_nothing_written(host.backend, before)


@pytest.mark.parametrize("field", ["req_pool_indices", "seq_lens", "out_cache_loc"])
def test_batch_tensors_rebound_after_planning_are_matched_by_value(
    host: SimpleNamespace, field: str
) -> None:
    """A tensor rebound to an equal copy is served (sglang's eager runner forwards such a copy
    of every planned batch); rebound to other values it is refused."""
    step = host.batches.decode([0, 1], [5, 9])
    host.backend.init_forward_metadata(step.batch)
    planned = getattr(step.batch, field)
    setattr(step.batch, field, planned.clone())
    run_all_layers(host, step)
    step.batch.seq_lens_cpu = None  # the device values decide
    setattr(step.batch, field, planned.flip(0))
    before = snapshot(host.backend)
    with pytest.raises(ContractError, match=rf"another batch: {field}\[0\]=.* but the plan"):
        run_all_layers(host, step)
    assert_nothing_written(host.backend, before)


def test_a_plan_of_inference_tensors_refilled_by_the_next_batch_is_refused(
    host: SimpleNamespace,
) -> None:
    """sglang's eager runner copies each batch into shared buffers; under inference mode their
    writes bump no version. A plan made from the buffers' views keeps the values it was made
    from, so the next batch refilled into the same buffers is refused."""
    fields = ("req_pool_indices", "seq_lens", "out_cache_loc")
    with torch.inference_mode():
        first = host.batches.decode([0, 1], [5, 9])
        nxt = host.batches.decode([0, 1], [6, 10])
        buffers = {name: getattr(first.batch, name).clone() for name in fields}
        planned = dataclasses.replace(first.batch, **buffers, seq_lens_cpu=None)
        host.backend.init_forward_metadata(planned)
        for name in fields:
            buffers[name].copy_(getattr(nxt.batch, name))
        refilled = dataclasses.replace(nxt.batch, **buffers, seq_lens_cpu=None)
        before = snapshot(host.backend)
        with pytest.raises(ContractError, match=r"seq_lens\[0\]=6 but the plan was made with"):
            run_all_layers(host, harness.Step(refilled, nxt.rows))
    assert_nothing_written(host.backend, before)


def test_a_host_agnostic_plan_for_another_batch_is_refused(host: SimpleNamespace) -> None:
    model, pool = host.model, host.pool
    metadata = plan(CONFIG, pool.decode([0, 1], [5, 9]))
    other = pool.decode([1, 0], [9, 5])  # same shapes, requests swapped
    inputs = model.inputs[0][0]
    rows = dataclasses.replace(inputs, q=inputs.q[:2], kv=inputs.kv[:2])
    with pytest.raises(ContractError, match=r"layer 0: .* another batch: req_pool_indices"):
        forward_layer(model.state, 0, metadata, other.req_pool_indices, rows, model.params[0])


def test_draft_extend_grown_by_a_real_request_is_refused(host: SimpleNamespace) -> None:
    """sglang pads a planned draft-extend batch; a real request appended is not padding."""
    step = host.batches.draft_extend([0, 1], [126, 30], 4)
    host.backend.init_forward_metadata(step.batch)
    step.batch.mark_forward_metadata_ready()
    padded = host.batches.pad(step, host.runner, 1, 4)
    batch = padded.batch
    batch.seq_lens_cpu[-1] = 44  # the appended request is a real one (seq len 44, not 1)
    before = snapshot(host.backend)
    with pytest.raises(ContractError) as refused:
        host.sim.layer(host.backend, padded, 0)
    message = str(refused.value)
    assert "planned with seq_lens_cpu=[130, 34] and the batch has [130, 34, 44]" in message
    assert "only padding requests (seq_lens_cpu 1)" in message
    assert_nothing_written(host.backend, before)


def test_draft_extend_grown_by_a_request_in_a_real_pool_row_is_refused(
    host: SimpleNamespace,
) -> None:
    step = host.batches.draft_extend([0, 1], [126, 30], 4)
    host.backend.init_forward_metadata(step.batch)
    padded = host.batches.pad(step, host.runner, 1, 4)
    padded.batch.req_pool_indices[-1] = 3  # pool row 3 holds request 2
    with pytest.raises(ContractError, match=r"req_pool_indices\[2\]=3 is past the planned"):
        host.sim.layer(host.backend, padded, 0)


def test_draft_extend_padded_after_planning_is_still_served(host: SimpleNamespace) -> None:
    step = host.batches.draft_extend([0, 1], [126, 30], 4)
    host.backend.init_forward_metadata(step.batch)
    padded = host.batches.pad(step, host.runner, 1, 4)
    out = host.sim.layer(host.backend, padded, 0)
    assert out[:8].abs().max() > 0 and out[-4:].abs().max() == 0  # padding attends to nothing


# ------------------------------------------------------------------ write slots and indices
def _plan_refused(host: SimpleNamespace, step: harness.Step, backend=None) -> str:
    backend = backend or host.backend
    before = snapshot(backend)
    with pytest.raises(BatchError) as refused:
        backend.init_forward_metadata(step.batch)
    assert_nothing_written(backend, before)
    assert backend.forward_metadata is None  # nothing stale left to run
    return str(refused.value)


def test_draft_slots_laid_out_steps_first_are_refused(host: SimpleNamespace) -> None:
    """The seed bug's sibling: the right length, laid out [num_steps, bs] not [bs, 1, steps]."""
    draft = DSV4MultiStepDraftBackend(host.runner, 1, 3, cache_format="dense")
    step = host.batches.draft([0, 1], [130, 30], 3)
    right = step.batch.out_cache_loc
    step.batch.out_cache_loc = right.view(2, 3).t().reshape(-1).clone()
    before = snapshot(draft.attn_backends[0])
    with pytest.raises(BatchError) as refused:
        draft.init_forward_metadata(step.batch)
    message = str(refused.value)
    # Step 0 of request 1 reads entry 3 of the buffer: request 1's step-1 slot in this layout.
    wrote, held = int(right[1 * 3 + 1]), int(right[1 * 3 + 0])
    assert f"out_cache_loc (draft step 0's slots, [batch, topk, steps])[1]={wrote}" in message
    assert f"req_to_token holds slot {held}" in message
    assert_nothing_written(draft.attn_backends[0], before)


@pytest.mark.parametrize("bad", [-1, -7])
def test_negative_write_slots_are_refused(host: SimpleNamespace, bad: int) -> None:
    step = host.batches.decode([0, 1], [5, 9])
    step.batch.out_cache_loc[1] = bad
    message = _plan_refused(host, step)
    assert f"out_cache_loc[1]={bad}; expected a full-cache slot in [0, " in message


def test_write_slots_beyond_the_cache_are_refused(host: SimpleNamespace) -> None:
    step = host.batches.extend([0], [0], [6])
    limit = min(host.backend.num_cache_slots, host.pool.full_to_swa.numel())
    step.batch.out_cache_loc[3] = limit
    message = _plan_refused(host, step)
    assert f"out_cache_loc[3]={limit}; expected a full-cache slot in [0, {limit})" in message


def test_a_write_slot_of_another_request_is_refused(host: SimpleNamespace) -> None:
    step = host.batches.decode([0, 1], [5, 9])
    theirs = int(host.pool.req_to_token[host.pool.pool_index(1), 4])
    step.batch.out_cache_loc[0] = theirs
    message = _plan_refused(host, step)
    ours = int(host.pool.req_to_token[host.pool.pool_index(0), 4])
    assert f"out_cache_loc[0]={theirs} but req_to_token holds slot {ours}" in message


def test_float_write_slots_are_refused(host: SimpleNamespace) -> None:
    step = host.batches.decode([0, 1], [5, 9])
    step.batch.out_cache_loc = step.batch.out_cache_loc.float()
    message = _plan_refused(host, step)
    assert "out_cache_loc has dtype torch.float32; expected an integer tensor" in message


@pytest.mark.parametrize("bad", [-1, 99])
def test_req_pool_indices_out_of_range_are_refused(host: SimpleNamespace, bad: int) -> None:
    """-1 would wrap to the last pool row (another request) without this check."""
    step = host.batches.decode([0, 1], [5, 9])
    step.batch.req_pool_indices[1] = bad
    message = _plan_refused(host, step)
    rows = host.pool.req_to_token.shape[0]
    assert f"req_pool_indices[1]={bad}; expected a row of req_to_token in [0, {rows})" in message


def test_float_host_lengths_are_refused(host: SimpleNamespace) -> None:
    step = host.batches.extend([0], [0], [6])
    step.batch.extend_seq_lens_cpu = [5.5]
    message = _plan_refused(host, step)
    assert "extend_seq_lens_cpu=[5.5]; expected integer host lengths" in message


def test_device_side_checks_are_raised_at_the_next_plan(
    host: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path without strict mode: planning does not read the checks; the bad rows
    write nothing, and the next plan raises the verdict."""
    monkeypatch.setattr(checks, "defer_checks", lambda device: True)
    step = host.batches.decode([0, 1], [1, 1])  # position 0: no earlier keys needed
    step.batch.out_cache_loc[1] = -1
    host.backend.init_forward_metadata(step.batch)  # not raised yet
    assert host.backend.forward_metadata.swa_out_loc[1] == -1  # the bad row writes nothing
    out = host.sim.layer(host.backend, step, 0)
    assert host.sim.max_error(step.rows[:1], 0, out[:1]) < 2e-5  # the good row is served
    nxt = host.batches.decode([0, 1], [2, 2])
    with pytest.raises(BatchError, match=r"out_cache_loc\[1\]=-1; .*device-side checks"):
        host.backend.init_forward_metadata(nxt.batch)
    host.backend.init_forward_metadata(nxt.batch)  # raised once; the next batch plans


# -------------------------------------------------------------------------- smaller items
def test_idle_forward_with_rows_in_q_is_refused(host: SimpleNamespace) -> None:
    empty = torch.zeros(0, dtype=torch.int64)
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    idle = ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=None, req_pool_indices=empty,
        seq_lens=empty, out_cache_loc=empty, seq_lens_sum=0,
    )  # fmt: skip
    host.backend.init_forward_metadata(idle)
    q = torch.zeros(3, CONFIG.num_heads, CONFIG.head_dim)
    layer = SimpleNamespace(layer_id=0)
    shape = rf"\(3, {CONFIG.num_heads}, {CONFIG.head_dim}\)"
    with pytest.raises(ContractError, match=f"forward: an IDLE batch has 0 rows .*{shape}"):
        host.backend.forward(q, q, q, layer, idle, attn_sink=torch.zeros(CONFIG.num_heads))
    with pytest.raises(ContractError, match=r"store_cache .*: an IDLE batch has 0 rows"):
        host.backend.store_cache(layer_id=0, swa_k=q[:, 0], forward_batch=idle)


@pytest.mark.parametrize("layer_id", [9, -1])
def test_layer_ids_out_of_range_are_refused(host: SimpleNamespace, layer_id: int) -> None:
    step = host.batches.decode([0, 1], [5, 9])
    host.backend.init_forward_metadata(step.batch)
    feed = host.sim.feed(step.rows, 1)
    expected = rf"layer_id={layer_id}; expected an integer in \[0, 4\)"
    with pytest.raises(ContractError, match=expected):
        host.backend.store_cache(layer_id=layer_id, swa_k=feed.kv, forward_batch=step.batch)
    compressor = host.sim.compressors[1]
    compressor.feed = feed
    with pytest.raises(ContractError, match=expected):
        host.backend.forward_core_compressor(feed.x, step.batch, layer_id, compressor)
    layer = SimpleNamespace(layer_id=layer_id)
    sink = torch.zeros(CONFIG.num_heads)
    with pytest.raises(ContractError, match=expected):
        host.backend.forward(feed.q, feed.q, feed.q, layer, step.batch, attn_sink=sink)


def test_two_dimensional_q_of_the_wrong_width_is_refused(host: SimpleNamespace) -> None:
    step = host.batches.decode([0, 1], [5, 9])
    host.backend.init_forward_metadata(step.batch)
    q = torch.zeros(2, CONFIG.head_dim + 3)
    layer = SimpleNamespace(layer_id=0)
    sink = torch.zeros(CONFIG.num_heads)
    with pytest.raises(ContractError, match=rf"q has shape \(2, {CONFIG.head_dim + 3}\); expected"):
        host.backend.forward(q, q, q, layer, step.batch, attn_sink=sink)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_attention_heads", "many", "num_attention_heads='many'; expected an integer"),
        ("compress_ratios", "0,4,128,4", "compress_ratios='0,4,128,4'; expected a list"),
        ("compress_ratios", [0, "4", 128, 4], "compress_ratios[1]='4'; expected an integer"),
        ("head_dim", 63.5, "head_dim=63.5; expected an integer"),
        ("rope_theta", "1e4", "rope_theta='1e4'; expected a finite number"),
        ("index_topk", True, "index_topk=True; expected an integer"),
    ],
)
def test_config_values_of_the_wrong_type_name_the_field(field, value, message) -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_hf({**HF, field: value})
    assert message in str(refused.value)


def test_deferred_checks_keep_a_bad_request_from_writing(
    host: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-1 in req_pool_indices would wrap to the last pool row; deferred, it writes nothing."""
    monkeypatch.setattr(checks, "defer_checks", lambda device: True)
    step = host.batches.extend([0], [0], [9])  # completes c4 blocks: ring and cache writes
    step.batch.req_pool_indices[0] = -1
    before = snapshot(host.backend)
    host.backend.init_forward_metadata(step.batch)
    run_all_layers(host, step)
    assert_nothing_written(host.backend, before)
    with pytest.raises(BatchError, match=r"req_pool_indices\[0\]=-1; expected a row"):
        host.backend.raise_pending_checks()


def test_a_real_token_taken_for_padding_is_refused(host: SimpleNamespace) -> None:
    """Tokens past sum(extend_seq_lens) are data-parallel padding (slot 0); one with a real
    slot means the host's extend lengths are wrong, and its key would never be written."""
    step = host.batches.extend([0, 1], [0, 0], [5, 3])
    step.batch.extend_seq_lens_cpu = [5, 2]  # one token of request 1 left out
    step.batch.extend_prefix_lens_cpu = [0, 0]
    step.batch.seq_lens_cpu = torch.tensor([5, 2])
    step.batch.seq_lens = torch.tensor([5, 2])
    slot = int(step.batch.out_cache_loc[7])
    message = _plan_refused(host, step)
    assert f"out_cache_loc[7]={slot} is past the requests' rows" in message
