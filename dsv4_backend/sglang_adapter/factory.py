"""The factory functions sglang calls to build this package's DeepSeek-V4 backends.

:func:`create_dsv4_backend` serves ``ATTENTION_BACKENDS["dsv4"]``; the two ``create_dsv4_draft_*``
functions replace ``DraftBackendFactory._create_dsv4_decode_backend`` and
``_create_dsv4_prefill_backend`` (see :mod:`dsv4_backend.registration`). Each imports its backend
module only when called, so registering the plugin stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dsv4_backend.errors import MissingBackendError

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from dsv4_backend.sglang_adapter.draft import DSV4MultiStepDraftBackend

#: The attention-backend name this package serves, and the stamp sglang's draft factory expects.
BACKEND_NAME = "dsv4"
#: The name under which sglang's own DeepSeek-V4 backend stays reachable.
BUILTIN_NAME = "dsv4_builtin"

BACKEND_MODULE = "dsv4_backend.sglang_adapter.backend"
DRAFT_MODULE = "dsv4_backend.sglang_adapter.draft"
DSPARK_MODULE = "dsv4_backend.sglang_adapter.dspark"


def adapter_class(module_name: str, class_name: str) -> type:
    """Import ``module_name`` and return its ``class_name``.

    Raises
    ------
    MissingBackendError
        When ``module_name`` itself is not part of this installation. A
        ``ModuleNotFoundError`` raised for any other module (a broken import inside the
        backend) propagates unchanged.
    """
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise MissingBackendError(
            f"{module_name}.{class_name} is missing: this installation of dsv4_backend has no "
            f"module {module_name}. Until it exists, serve DeepSeek-V4 with sglang's own "
            f"backend: --attention-backend {BUILTIN_NAME}, or set SGLANG_PLUGINS to exclude "
            "dsv4_backend."
        ) from exc
    return getattr(module, class_name)


def create_dsv4_backend(runner: ModelRunner) -> AttentionBackend:
    """Build this package's attention backend for ``runner`` (``ATTENTION_BACKENDS["dsv4"]``):
    ``DSparkDraftBackend`` for the DSpark draft runner, else ``DSV4AttentionBackend``."""
    if is_dspark_draft(runner):
        return adapter_class(DSPARK_MODULE, "DSparkDraftBackend")(runner)
    return adapter_class(BACKEND_MODULE, "DSV4AttentionBackend")(runner)


def is_dspark_draft(runner: ModelRunner) -> bool:
    """Whether ``runner`` is the draft runner of ``--speculative-algorithm DSPARK``."""
    algorithm = getattr(getattr(runner, "server_args", None), "speculative_algorithm", None)
    return str(algorithm or "").upper() == "DSPARK" and bool(
        getattr(runner, "is_draft_worker", False)
    )


def create_dsv4_draft_decode_backend(
    factory: DraftBackendFactory,
) -> tuple[str, DSV4MultiStepDraftBackend]:
    """Build the multi-step draft decode backend: one backend per speculative step.

    Installed as ``DraftBackendFactory._create_dsv4_decode_backend``, so ``factory`` is the
    draft factory instance; returns ``("dsv4", backend)`` like the method it replaces.
    """
    backend_class = adapter_class(DRAFT_MODULE, "DSV4MultiStepDraftBackend")
    backend = backend_class(factory.draft_model_runner, factory.topk, factory.speculative_num_steps)
    return BACKEND_NAME, backend


def create_dsv4_draft_extend_backend(factory: DraftBackendFactory) -> tuple[str, AttentionBackend]:
    """Build the draft-extend backend for the draft model runner.

    Installed as ``DraftBackendFactory._create_dsv4_prefill_backend``; returns
    ``("dsv4", backend)`` like the method it replaces.
    """
    return BACKEND_NAME, create_dsv4_backend(factory.draft_model_runner)
