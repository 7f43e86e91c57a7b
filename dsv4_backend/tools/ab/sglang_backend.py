"""``sglang:<name>``: an sglang-registered attention backend driven by the simulated host.

The backend is built the way sglang builds it, from the registry (``ATTENTION_BACKENDS[name]``)
and, for the multi-step draft, by sglang's ``DraftBackendFactory._create_<name>_decode_backend``
(``dsv4_builtin``'s is added by this package's plugin), over the mock model
runner of :mod:`dsv4_backend.testing.harness`; ``harness.SimulatedModel`` runs each
layer through the backend's sglang-facing methods (store, indexer, compressor, attention), fed
from the same ``RandomModel`` data as the other side. This package's plugin is registered
first, so ``dsv4`` is this package's adapter and ``dsv4_builtin`` sglang's own backend.

Differences from the ``dsv4`` backends, by construction of the simulated host:

* rows fed a rejected draft get the true inputs (the harness carries row identity, not
  wrong tokens); those rows are not compared and their writes are overwritten before any
  later row can see them, so the other side's outputs are unaffected;
* the graph path plans with ``init_forward_metadata_out_graph`` into the backend's own graph
  state, without padding the batch;
* kernel time includes the stand-ins' gathering of each layer's inputs;
* sglang backends keep FP8 caches (``cache_format``): against ``dsv4-fp8`` or another sglang
  backend the same-format tolerance applies, against a dense side the FP8 one (:mod:`.tolerance`).

The CLI refuses these backends without a CUDA device (``make_backend``); sglang's own
DeepSeek-V4 backend also needs ``head_dim`` 512 (``--config`` with real dimensions) and
sglang's real KV pool, which the mock runner only stands in for.
"""

from __future__ import annotations

import time

import torch

from dsv4_backend.errors import ConfigError
from dsv4_backend.testing import harness
from dsv4_backend.tools.ab.base import Backend, StepOutput
from dsv4_backend.tools.ab.trace import NUM_DRAFT_STEPS, NUM_DRAFT_TOKENS, Step, Trace


class SglangBackend(Backend):
    """The sglang attention backend registered as ``backend_name`` (module docstring).

    Raises ``ConfigError`` when sglang has no backend of that name.
    """

    cache_format = "fp8"

    def __init__(self, backend_name: str) -> None:
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        from dsv4_backend.registration import register

        register()
        if backend_name not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"sglang has no attention backend {backend_name!r}; registered: "
                f"{', '.join(sorted(ATTENTION_BACKENDS))}"
            )
        self.name = f"sglang:{backend_name}"
        self.backend_name = backend_name
        self.device = torch.device("cpu")

    @property
    def kernel_path(self) -> str:
        return f"sglang {self.backend_name} ({self.device})"

    def prepare(self, trace: Trace, device: torch.device) -> None:
        """Build the mock runner, the target and draft backends and their graph state.

        Raises ``ConfigError`` when sglang cannot build the backend on this runner, or for a
        DeepSeek-V4.1 trace (its simulated host drives DeepSeek-V4 models only).
        """
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.speculative.draft_utils import DraftBackendFactory

        if trace.config.v41 is not None:
            raise ConfigError(
                f"{self.name}: DeepSeek-V4.1 traces run the dsv4 backends and the reference; "
                "the sglang:<name> backends' simulated host drives DeepSeek-V4 models only"
            )
        self.device = device
        model = trace.build_model(device)
        pool = model.pool
        runner = harness.mock_runner(
            pool,
            harness.tiny_hf_config(trace.config),
            num_steps=NUM_DRAFT_STEPS,
            num_draft_tokens=NUM_DRAFT_TOKENS,
        )
        runner.draft_attention_backend = self.backend_name
        try:
            self.target = ATTENTION_BACKENDS[self.backend_name](runner)
            runner.attn_backend = self.target
            # The factory's per-backend method: its create_decode_backend reads sglang's
            # runtime context, which only a launched server publishes.
            factory = DraftBackendFactory(runner, topk=1, speculative_num_steps=NUM_DRAFT_STEPS)
            _, self.draft = getattr(factory, f"_create_{self.backend_name}_decode_backend")()
            max_rows = trace.max_rows
            for backend in (self.target, self.draft):
                backend.init_cuda_graph_state(pool.num_requests, max_rows)
        except Exception as exc:  # sglang raises anything from asserts to AttributeError
            raise ConfigError(
                f"sglang backend {self.backend_name!r} cannot run on the A/B tool's simulated "
                f"host: {type(exc).__name__}: {exc}"
            ) from exc
        self.model = harness.SimulatedModel(model)

    def run(self, step: Step) -> StepOutput:
        sim_step = harness.forward_batch(step.batch(self.model.model.pool), step.rows())
        backend = self.target if step.mode != "draft" else self.draft.attn_backends[step.step_id]
        sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        start = time.perf_counter()
        if step.path == "eager":
            backend.init_forward_metadata(sim_step.batch)
        else:
            backend.init_forward_metadata_out_graph(sim_step.batch)
            backend.init_forward_metadata_in_graph(sim_step.batch)
        sync()
        planned = time.perf_counter()
        layers = step.layers(self.model.model.config)
        outputs = [self.model.layer(backend, sim_step, layer) for layer in layers]
        sync()
        return StepOutput(
            rows=list(sim_step.rows),
            layers=layers,
            outputs=[out.float().cpu() for out in outputs],
            plan_s=planned - start,
            kernel_s=time.perf_counter() - planned,
        )
