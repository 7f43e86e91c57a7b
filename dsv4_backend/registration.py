"""The sglang plugin entry point: make this package serve the ``dsv4`` attention backend.

sglang runs :func:`register` through ``sglang.srt.plugins.load_plugins()`` in every process
(the entry point ``dsv4_backend`` in the group ``sglang.srt.plugins``; ``SGLANG_PLUGINS``
naming other plugins keeps it from running). It changes four things in sglang 0.5.23:

1. ``ATTENTION_BACKENDS["dsv4"]`` builds this package's backend;
2. sglang's own factory moves to ``ATTENTION_BACKENDS["dsv4_builtin"]``, and ``dsv4_builtin``
   joins the ``--attention-backend`` choices;
3. ``DraftBackendFactory``'s DeepSeek-V4 entries (multi-step draft decode, draft extend) build
   this package's backends; sglang's own stay reachable for ``dsv4_builtin``;
4. sglang's DeepSeek-V4 model override forces ``attention_backend="dsv4"``; an extra override
   keeps an explicit ``dsv4_builtin`` request instead.

On platforms this package does not serve (``unserved_platform``: HIP, NPU, ...) it changes
nothing and one INFO line says so. Nothing heavy is imported and no kernel is compiled: the
factories import the backend lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any

from dsv4_backend import _versions
from dsv4_backend.sglang_adapter import factory
from dsv4_backend.sglang_adapter.factory import BACKEND_NAME, BUILTIN_NAME

if TYPE_CHECKING:
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

logger = logging.getLogger("sglang.srt.plugins.dsv4_backend")

#: The architecture whose sglang model override forces ``attention_backend="dsv4"``.
DSV4_ARCHITECTURE = "DeepseekV4ForCausalLM"
_ATTENTION_BACKEND_FIELDS = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
)


def register() -> None:
    """Make this package serve ``dsv4``; idempotent (a second call changes nothing).

    Raises
    ------
    ConfigError
        When the installed sglang is outside ``SUPPORTED_SGLANG``; sglang is left untouched.
    """
    _versions.check_sglang_version(metadata.version("sglang"))
    platform = unserved_platform()
    if platform is not None:
        logger.info(
            "dsv4 attention backend: left to sglang on %s (dsv4_backend serves CUDA; sglang's "
            "registry picks its own backend for this platform).",
            platform,
        )
        return

    # Importing these modules runs sglang's own registrations first.
    import sglang.srt.arg_groups.model_overrides  # noqa: F401
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.arg_groups.model_override_base import register_model_override
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    builtin = ATTENTION_BACKENDS[BACKEND_NAME]
    if builtin is factory.create_dsv4_backend:
        return
    if BUILTIN_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BUILTIN_NAME])
    _replace_draft_factories(DraftBackendFactory)
    # Registered after sglang's own DeepSeek-V4 override, so this one's declaration wins.
    register_model_override(DSV4_ARCHITECTURE)(keep_builtin_request)
    ATTENTION_BACKENDS[BUILTIN_NAME] = builtin
    ATTENTION_BACKENDS[BACKEND_NAME] = factory.create_dsv4_backend
    logger.info(
        "dsv4 attention backend: served by dsv4_backend (%s); sglang's own is %r.",
        _versions.installed_version("dsv4-backend"),
        BUILTIN_NAME,
    )


def unserved_platform() -> str | None:
    """The platform sglang runs on when it is not one this package serves, else None.

    Served: CUDA (and the CPU, where the tests run the torch and interpreter paths). On HIP
    and NPU sglang's own ``dsv4`` factory picks a per-platform backend whose model path calls
    methods this backend lacks (``get_unified_swa_loc``); XPU, MUSA and MPS have no kernel
    path here. Uses sglang's own platform predicates.
    """
    from sglang.srt.utils import common

    for name, found in (
        ("HIP (ROCm)", common.is_hip),
        ("NPU", common.is_npu),
        ("XPU", common.is_xpu),
        ("MUSA", common.is_musa),
        ("MPS", common.is_mps),
    ):
        if found():
            return name
    return None


def _replace_draft_factories(draft_factory: type[DraftBackendFactory]) -> None:
    """Point the DeepSeek-V4 draft entries at this package; keep sglang's under builtin names."""
    draft_factory._create_dsv4_builtin_decode_backend = draft_factory._create_dsv4_decode_backend
    draft_factory._create_dsv4_builtin_prefill_backend = draft_factory._create_dsv4_prefill_backend
    draft_factory._create_dsv4_decode_backend = factory.create_dsv4_draft_decode_backend
    draft_factory._create_dsv4_prefill_backend = factory.create_dsv4_draft_extend_backend
    draft_factory._create_backend = _offering_builtin(draft_factory._create_backend)


def _offering_builtin(create_backend: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``DraftBackendFactory._create_backend`` so its backend maps also hold ``dsv4_builtin``.

    sglang builds each backend map inside ``create_decode_backend`` and
    ``create_draft_extend_backend``; the wrapper adds the entry where the map is passed on.
    """

    def create_backend_with_builtin(
        draft_factory: DraftBackendFactory,
        backend_name: str,
        backend_map: dict[str, Callable[[], Any]],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        entry = builtin_draft_entry(draft_factory, backend_map)
        if entry is not None:
            backend_map = {**backend_map, BUILTIN_NAME: entry}
        return create_backend(draft_factory, backend_name, backend_map, *args, **kwargs)

    return create_backend_with_builtin


def builtin_draft_entry(
    draft_factory: DraftBackendFactory, backend_map: dict[str, Callable[[], Any]]
) -> Callable[[], Any] | None:
    """Return sglang's own DeepSeek-V4 draft factory matching ``backend_map``'s ``dsv4`` entry.

    ``None`` when the map has no ``dsv4`` entry of this package (a map of another kind).
    """
    entry = backend_map.get(BACKEND_NAME)
    if entry == draft_factory._create_dsv4_decode_backend:
        return draft_factory._create_dsv4_builtin_decode_backend
    if entry == draft_factory._create_dsv4_prefill_backend:
        return draft_factory._create_dsv4_builtin_prefill_backend
    return None


def keep_builtin_request(server_args: Any, hf_config: Any) -> dict[str, str]:
    """Model override for DeepSeek-V4: keep the backend fields the user set to ``dsv4_builtin``.

    sglang's own override declares ``dsv4`` for them, which would silently route an explicit
    ``--attention-backend dsv4_builtin`` back to this package. Follows sglang's provider
    contract: reads the raw ``server_args`` (``hf_config`` is not needed), mutates nothing,
    returns the declarations.
    """
    return {
        field: BUILTIN_NAME
        for field in _ATTENTION_BACKEND_FIELDS
        if getattr(server_args, field, None) == BUILTIN_NAME
    }
