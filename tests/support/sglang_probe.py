"""Probe a fresh interpreter's sglang after it loads its plugins; used by
``adapter/test_registration.py``.

usage: python tests/support/sglang_probe.py OUT.json [--full]

Loads plugins the way sglang does (``sglang.srt.plugins.load_plugins()``, honouring
``SGLANG_PLUGINS``), then writes what sglang's attention registry, server-args parser and draft
factory hold to ``OUT.json``. ``--full`` adds what needs this package loaded: calls of the draft
factory entries, the DeepSeek-V4 model override, a second ``register()``, the log records and a
``spawn``-started child's registry. Both end with what ``python -m dsv4_backend info`` prints in
that process (its ``main``, as the command runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import multiprocessing
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any

DSV4_ARCHITECTURE = "DeepseekV4ForCausalLM"
DRAFT_METHODS = {
    "decode": "_create_dsv4_decode_backend",
    "extend": "_create_dsv4_prefill_backend",
}


class _Records(logging.Handler):
    """Keep the messages of one logger."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.INFO)
        self.name_kept = name
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == self.name_kept:
            self.messages.append(record.getMessage())


def qualified(function: Callable[..., Any] | None) -> str | None:
    """``module.qualname`` of a function or bound method; ``None`` for ``None``."""
    if function is None:
        return None
    function = getattr(function, "__func__", function)
    return f"{function.__module__}.{function.__qualname__}"


def registry() -> dict[str, str | None]:
    """Load sglang's plugins; return what ``dsv4`` and ``dsv4_builtin`` resolve to."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    return {name: qualified(ATTENTION_BACKENDS.get(name)) for name in ("dsv4", "dsv4_builtin")}


def server_args(*cli: str) -> Any:
    """Build ``ServerArgs`` through sglang's own parser; ``None`` when the parser refuses."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        args = parser.parse_args(["--model-path", "dummy", *cli])
    except argparse.ArgumentError:
        return None
    return ServerArgs.from_cli_args(args)


def parsed_backend(name: str) -> str | None:
    """The ``attention_backend`` sglang's parser yields for ``--attention-backend name``."""
    args = server_args("--attention-backend", name)
    return None if args is None else args.attention_backend


def declared_backend(*cli: str) -> str:
    """The ``attention_backend`` after sglang's DeepSeek-V4 model overrides are declared."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.arg_groups.overrides import collect_model_override_declarations

    # A fixed MoE runner keeps sglang's override from reading the (absent) checkpoint.
    args = server_args("--moe-runner-backend", "triton", *cli)
    hf_config = types.SimpleNamespace(architectures=[DSV4_ARCHITECTURE], model_type="deepseek_v4")
    args._resolved_overrides = collect_model_override_declarations(
        DSV4_ARCHITECTURE, args, hf_config
    )
    return resolved_view(args).attention_backend


def call(function: Callable[[], tuple[str, object]]) -> dict[str, Any]:
    """Call a draft factory entry; describe its result, or the exception it raised and the
    files of the frames it passed through."""
    try:
        stamp, backend = function()
    except Exception as exc:
        error = type(exc)
        return {
            "error": f"{error.__module__}.{error.__qualname__}",
            "message": str(exc),
            "files": [frame.filename for frame in traceback.extract_tb(exc.__traceback__)],
        }
    return {"stamp": stamp, "backend_module": type(backend).__module__}


def registration_state() -> list[object]:
    """Every object register() may set, in order, for an identity comparison."""
    from sglang.srt.arg_groups import model_override_base
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    return [
        *ATTENTION_BACKENDS,
        *ATTENTION_BACKENDS.values(),
        *ATTENTION_BACKEND_CHOICES,
        *vars(DraftBackendFactory),
        *vars(DraftBackendFactory).values(),
        *model_override_base._MODEL_OVERRIDE_FNS[DSV4_ARCHITECTURE],
    ]


def info_report() -> str:
    """What ``python -m dsv4_backend info`` prints, and its exit status 0."""
    from dsv4_backend import __main__ as cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(["info"])
    assert status == 0, f"info exited {status}"
    return out.getvalue()


def probe(full: bool) -> dict[str, Any]:
    """Collect the facts; ``full`` adds those that need this package loaded."""
    records = _Records("sglang.srt.plugins.dsv4_backend")
    sglang_logger = logging.getLogger("sglang")
    sglang_logger.setLevel(logging.INFO)
    sglang_logger.addHandler(records)

    facts: dict[str, Any] = {"registry": registry()}
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    facts["parsed"] = {name: parsed_backend(name) for name in ("dsv4", "dsv4_builtin")}
    facts["draft_functions"] = {
        kind: qualified(getattr(DraftBackendFactory, method))
        for kind, method in DRAFT_METHODS.items()
    }
    if not full:
        facts["info"] = info_report()
        return facts

    from dsv4_backend.registration import builtin_draft_entry, register

    draft_factory = DraftBackendFactory(
        types.SimpleNamespace(draft_attention_backend=None), topk=1, speculative_num_steps=3
    )
    facts["draft_calls"] = {
        kind: call(getattr(draft_factory, method)) for kind, method in DRAFT_METHODS.items()
    }
    facts["draft_builtin"] = {
        kind: qualified(
            builtin_draft_entry(draft_factory, {"dsv4": getattr(draft_factory, method)})
        )
        for kind, method in DRAFT_METHODS.items()
    }
    facts["draft_create_backend"] = qualified(DraftBackendFactory._create_backend)
    facts["declared"] = {
        "dsv4_builtin": declared_backend("--attention-backend", "dsv4_builtin"),
        "unset": declared_backend(),
    }
    before = registration_state()
    register()
    after = registration_state()
    facts["register_again_same_objects"] = len(before) == len(after) and all(
        a is b for a, b in zip(before, after, strict=True)
    )
    facts["log"] = records.messages
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        facts["spawned_registry"] = pool.apply(registry)
    facts["info"] = info_report()
    return facts


if __name__ == "__main__":
    with open(sys.argv[1], "w") as out:
        json.dump(probe(full="--full" in sys.argv[2:]), out, indent=2)
