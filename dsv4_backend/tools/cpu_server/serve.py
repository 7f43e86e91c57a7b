"""``python -m dsv4_backend serve``: sglang's own HTTP server on the CPU, through this backend.

The server is sglang's (``sglang.launch_server``: scheduler, tokenizer manager, OpenAI API);
this module only chooses its arguments and environment: the CPU serving kit
(:mod:`dsv4_backend.tools.cpu_server.standins`) in sglang's processes, ``--attention-backend
dsv4`` on ``--device cpu`` without CUDA graphs, a pool small enough for a laptop, and, with
``--tiny``, a tiny DeepSeek-V4 checkpoint written first (:mod:`.checkpoint`).

``CPU_SERVER_ARGS`` and ``environment.kit_environment`` are also what the server tests and the
server-level A/B start their servers and ``Engine`` objects with.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dsv4_backend.tools.cpu_server.environment import kit_environment

#: sglang server arguments of a CPU server (``sglang.Engine`` keywords; the command line
#: spells them ``--max-total-tokens 8192`` ...). The window pool is half the full pool: at
#: sglang's default 0.1 of 8192 tokens (3 pages) its scheduler spins on a second long prompt
#: (``mem_cache/prefill_budget.py`` ``SWAPrefillBudget.has_capacity``).
CPU_SERVER_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "dsv4",
    "disable_cuda_graph": True,
    "max_total_tokens": 8192,
    "swa_full_tokens_ratio": 0.5,
}
#: ``--speculative-algorithm EAGLE`` with the checkpoint's MTP layer as the draft (the tiny
#: checkpoint's ``v4`` variant), two draft steps, the only EAGLE shape the backend serves.
EAGLE_ARGS: dict[str, Any] = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 2,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 3,
}
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 30000
#: Where ``--tiny`` writes its checkpoint unless ``--checkpoint-dir`` says otherwise.
TINY_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv4_backend"


def command_line(options: Mapping[str, Any]) -> list[str]:
    """sglang's command-line flags of ``options`` (``Engine`` keywords): ``True`` -> a bare
    flag, ``False`` / ``None`` -> left out, other values -> ``--flag value``."""
    flags: list[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flags.append("--" + key.replace("_", "-"))
        if value is not True:
            flags.append(str(value))
    return flags


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    """Add the ``serve`` command to ``commands``."""
    serve = commands.add_parser(
        "serve",
        help="sglang's HTTP server on the CPU through this backend (--tiny: a tiny checkpoint)",
        description=(
            "Start sglang's own HTTP server (sglang.launch_server) on the CPU with the dsv4 "
            "attention backend and the CPU serving kit. Every other argument goes to sglang "
            "unchanged and overrides these defaults: "
            + " ".join(command_line(CPU_SERVER_ARGS))
            + f" --host {DEFAULT_HOST} --port {DEFAULT_PORT}."
        ),
    )
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--tiny",
        nargs="?",
        const="v4",
        metavar="VARIANT",
        help="write the tiny DeepSeek-V4 checkpoint of VARIANT (default v4) and serve it",
    )
    source.add_argument("--model-path", help="serve this checkpoint directory instead")
    serve.add_argument(
        "--checkpoint-dir",
        type=Path,
        help=f"where --tiny writes its checkpoint (default {TINY_CACHE}/tiny-VARIANT)",
    )
    serve.add_argument(
        "--eagle",
        action="store_true",
        help="EAGLE with the checkpoint's MTP layer: " + " ".join(command_line(EAGLE_ARGS)),
    )
    serve.add_argument(
        "--triton",
        action="store_true",
        help="this backend's Triton kernels in Triton's interpreter (slow) instead of torch",
    )
    # Every other argument is sglang's (main() hands them over as args.unknown).
    serve.set_defaults(run=run_serve, passes_unknown=True)


def server_argv(model_path: str | Path, *, eagle: bool, extra: Sequence[str] = ()) -> list[str]:
    """``python -m sglang.launch_server`` arguments of a CPU server of ``model_path``."""
    options = {"model_path": str(model_path), **CPU_SERVER_ARGS, **(EAGLE_ARGS if eagle else {})}
    defaults = ["--host", DEFAULT_HOST, "--port", str(DEFAULT_PORT)]
    return ["-m", "sglang.launch_server", *command_line(options), *defaults, *extra]


def run_serve(args: argparse.Namespace) -> int:
    """Write the tiny checkpoint (``--tiny``), then replace this process with sglang's server."""
    model_path = args.model_path
    if args.tiny is not None:
        from dsv4_backend.tools.cpu_server.checkpoint import write_tiny_checkpoint

        directory = args.checkpoint_dir or TINY_CACHE / f"tiny-{args.tiny}"
        model_path = write_tiny_checkpoint(directory, variant=args.tiny)
        print(f"dsv4-backend serve: tiny {args.tiny} checkpoint in {model_path}", flush=True)
    argv = server_argv(model_path, eagle=args.eagle, extra=args.unknown)
    env = {**os.environ, **kit_environment(triton=args.triton)}
    os.execve(sys.executable, [sys.executable, *argv], env)
    return 0  # not reached: execve replaces the process
