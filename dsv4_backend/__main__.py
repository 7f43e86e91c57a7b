"""Command line: ``python -m dsv4_backend COMMAND`` (also installed as ``dsv4-backend``).

Each command is a subparser whose ``run`` default takes the parsed arguments and returns the
exit status; add a command by adding an ``_add_*_command`` function to :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dsv4_backend.errors import ConfigError, DSV4Error
from dsv4_backend.testing.ab.cli import OneLineErrorParser, add_ab_parser
from dsv4_backend.tools.cpu_server.serve import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of all commands."""
    parser = OneLineErrorParser(
        prog="python -m dsv4_backend",
        error_prefix="dsv4-backend",
        description="DeepSeek-V4 attention backend for sglang.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_info_command(commands)
    add_ab_parser(commands)
    add_serve_parser(commands)
    # Named in the one-line error for a missing command (argparse names the metavar).
    commands.metavar = "{" + ",".join(commands.choices) + "}"
    return parser


def _add_info_command(commands: argparse._SubParsersAction) -> None:
    info = commands.add_parser(
        "info",
        help="versions, runnable kernel paths, and what sglang's registry resolves dsv4 to",
        description=(
            "Print the installed versions of torch, triton, tvm, flashinfer and sglang; which "
            "kernel paths can run on this machine and why not; and whether sglang's attention "
            "registry resolves dsv4 to this package after loading its plugins."
        ),
    )
    info.add_argument(
        "--device",
        help="describe the kernel choice for tensors on this device (default: cuda:0 where a "
        "GPU is visible, else cpu)",
    )
    info.add_argument(
        "--json", action="store_true", help="print the report as one JSON object instead"
    )
    info.set_defaults(run=_run_info)


def _run_info(args: argparse.Namespace) -> int:
    """Print the info report (text, or JSON with ``--json``)."""
    import json

    import torch

    from dsv4_backend import info

    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ConfigError(f"--device {args.device!r}: expected e.g. cpu or cuda:0") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {args.device}: no CUDA device is visible to torch")
    if args.json:
        print(json.dumps(info.json_report(args.device), indent=2))
    else:
        print("\n".join(info.report(args.device)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "passes_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown = unknown
    try:
        return args.run(args)
    except DSV4Error as error:  # a bad option value or setting: one line, as usage errors
        print(f"dsv4-backend {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
