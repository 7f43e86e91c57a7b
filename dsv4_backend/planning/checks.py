"""The value checks of a batch at the planning boundary, and where their verdict is read.

``plan`` checks, before anything is written, that every row's indices are in range and that
its write slot is the slot ``req_to_token`` holds for its position (``BatchView`` itself checks
shapes and integer dtypes). The checks are computed on the batch's device as one small
``[num_checks, 4]`` int64 record ``(failed, first bad index, its value, the expected value)``;
reading it is the only host sync, so *when* it is read depends on where the tensors live:

* CPU tensors, or **strict mode**: read at once; ``plan`` raises ``BatchError`` naming the field
  and the value, and nothing has been written.
* CUDA tensors, strict mode off (the default on GPUs): the record is copied to pinned host
  memory without a sync (``PendingChecks``); the host reads it at its next safe point (the
  sglang adapter: the next plan) and raises ``BatchError`` then. Meanwhile the requests with a
  row that failed a check write nothing (their write slots are ``-1``) and gather only
  in-range indices.

On the Triton paths the checks are one kernel launch (``planning/kernels/plan_fields.py``'s
``check_rows``) and ``settle`` turns its record into the verdict.

Strict mode is on when the environment variable ``DSV4_STRICT_CHECKS`` is ``1`` (the test suite
and the A/B tool set it) or inside ``strict_checks()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsv4_backend import envs
from dsv4_backend.errors import BatchError, DSV4Error

_strict_override: list[bool] = []


def strict_checks_enabled() -> bool:
    """Whether device-side checks are read (one host sync per plan) before anything is written."""
    if _strict_override:
        return _strict_override[-1]
    return envs.STRICT_CHECKS.get() == "1"


@contextlib.contextmanager
def strict_checks(enabled: bool = True) -> Iterator[None]:
    """Strict mode on (or off) inside the block, whatever ``DSV4_STRICT_CHECKS`` says."""
    _strict_override.append(enabled)
    try:
        yield
    finally:
        _strict_override.pop()


def defer_checks(device: torch.device) -> bool:
    """True where reading the checks would sync the device and strict mode is off."""
    return device.type != "cpu" and not strict_checks_enabled()


@dataclass(frozen=True)
class Check:
    """One named check over ``N`` entries: ``bad`` ``[N]`` bool, ``values`` ``[N]`` int and
    optionally ``expected`` ``[N]`` int and ``indices`` ``[N]`` int (what each entry reports
    as its index; default its position in ``bad``). Any shape ``[...]`` is read flattened.

    ``message`` is formatted with ``index``, ``value`` and ``expected`` of the first bad entry.
    """

    message: str
    bad: torch.Tensor
    values: torch.Tensor
    expected: torch.Tensor | None = None
    indices: torch.Tensor | None = None


def _record(checks: list[Check], device: torch.device) -> torch.Tensor:
    """``[len(checks), 4]`` int64: (any bad, first bad index, its value, expected) per check."""
    rows = []
    for check in checks:
        bad = check.bad.reshape(-1)
        if bad.numel() == 0:
            rows.append(torch.zeros(4, dtype=torch.int64, device=device))
            continue
        values = check.values.reshape(-1).long()
        expected = values if check.expected is None else check.expected.reshape(-1).long()
        first = torch.argmax(bad.to(torch.int8)).view(1)  # index_select: no host read
        index = first if check.indices is None else check.indices.reshape(-1)[first].long()
        picked = [values.index_select(0, first), expected.index_select(0, first)]
        rows.append(torch.cat([bad.any().long().view(1), index, *picked]))
    return torch.stack(rows)


def _failure(messages: tuple[str, ...], record: list[list[int]]) -> str | None:
    for message, (failed, index, value, expected) in zip(messages, record, strict=True):
        if failed:
            return message.format(index=index, value=value, expected=expected)
    return None


#: What a forward did meanwhile when a planning check it deferred fails.
WROTE_NOTHING = "its requests with a failing row wrote nothing"


@dataclass(frozen=True)
class PendingChecks:
    """A batch's checks whose verdict is still on its way to the host (see module docstring).

    ``host`` ``[k, 4]`` int64 (pinned) receives the record; ``event`` marks the copy's end.
    A failure raises ``error`` and says ``consequence`` (what the forward did meanwhile).
    """

    messages: tuple[str, ...]
    host: torch.Tensor
    event: torch.cuda.Event | None
    where: str
    error: type[DSV4Error] = BatchError
    consequence: str = WROTE_NOTHING

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def raise_if_failed(self) -> None:
        """``self.error`` when a check failed (waits for the copy if it is not done yet)."""
        if self.event is not None:
            self.event.synchronize()
        failure = _failure(self.messages, self.host.tolist())
        if failure is not None:
            raise self.error(
                f"{failure} (found by the device-side checks of {self.where}; {self.consequence})"
            )


def run_checks(
    checks: list[Check],
    device: torch.device,
    where: str,
    *,
    error: type[DSV4Error] = BatchError,
    consequence: str = WROTE_NOTHING,
) -> PendingChecks | None:
    """Raise ``error`` for the first failed check now, or return them pending.

    Pending (``defer_checks(device)``): the record is copied to pinned host memory without a
    sync; the caller keeps the ``PendingChecks`` (raising ``error``, saying ``consequence``)
    and calls ``raise_if_failed`` later.
    """
    if not checks or device.type == "meta":  # meta tensors hold no values to check
        return None
    messages = tuple(check.message for check in checks)
    if not defer_checks(device):
        # One read of the verdicts; the record (first bad entry) only for a failed check.
        failed = torch.stack([check.bad.any() for check in checks]).tolist()
        for check, bad in zip(checks, failed, strict=True):
            if bad:
                raise error(_failure((check.message,), _record([check], device).tolist()))
        return None
    return settle(messages, _record(checks, device), where, error=error, consequence=consequence)


def settle(
    messages: tuple[str, ...],
    record: torch.Tensor,
    where: str,
    *,
    error: type[DSV4Error] = BatchError,
    consequence: str = WROTE_NOTHING,
) -> PendingChecks | None:
    """The verdict of a computed ``[len(messages), 4]`` record (``_record``'s layout): read at
    once (``error`` for the first failed check) unless ``defer_checks``; then copied to pinned
    host memory without a sync and returned pending (``run_checks``)."""
    if not defer_checks(record.device):
        failure = _failure(messages, record.tolist())
        if failure is not None:
            raise error(failure)
        return None
    event = None
    if record.device.type == "cuda":
        host = torch.empty(record.shape, dtype=record.dtype, pin_memory=True)
        host.copy_(record, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host = record
    return PendingChecks(
        messages=messages,
        host=host,
        event=event,
        where=where,
        error=error,
        consequence=consequence,
    )
