"""What the A/B runner drives: the :class:`Backend` interface and one step's :class:`StepOutput`.

Kept apart from :mod:`.backends` (which builds backends by name) so that backends defined in
other modules, such as :mod:`.sglang_backend`, import it without a cycle.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from dsv4_backend.tools.ab.trace import Row, Step, Trace


@dataclass
class StepOutput:
    """One backend's result of one step.

    Attributes
    ----------
    rows : ``(request, position)`` of each output row (graph padding removed).
    layers : layer ids of ``outputs``.
    outputs : per layer ``[T, H, D]`` float32 on the CPU.
    plan_s, kernel_s : seconds spent planning and in the layers' kernels.
    layer_rows : the rows of each of ``outputs`` where they are not ``rows`` (DeepSeek-V4.1's
        late layers under the bounded replay: the late-layer tail's); None: ``rows`` for all.
    """

    rows: list[Row]
    layers: list[int]
    outputs: list[torch.Tensor]
    plan_s: float
    kernel_s: float
    layer_rows: list[list[Row]] | None = None

    def rows_of(self, index: int) -> list[Row]:
        """The rows of ``outputs[index]``."""
        return self.rows if self.layer_rows is None else self.layer_rows[index]


class Backend(abc.ABC):
    """What the runner drives: ``prepare`` once per trace, then ``run`` every step in order."""

    name: str
    #: ``"dense"`` (float32) or ``"fp8"`` (sglang's layout) caches: with the device, both sides'
    #: formats give the run's default tolerance (:mod:`.tolerance`).
    cache_format: str = "dense"

    @property
    @abc.abstractmethod
    def kernel_path(self) -> str:
        """Which kernels run, for the report."""

    @abc.abstractmethod
    def prepare(self, trace: Trace, device: torch.device) -> None:
        """Build this backend's model (from ``trace``'s seed) and state on ``device``."""

    @abc.abstractmethod
    def run(self, step: Step) -> StepOutput:
        """Run the next step of the trace (steps come in trace order)."""
