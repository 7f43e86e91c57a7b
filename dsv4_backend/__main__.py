"""Command line: ``python -m dsv4_backend COMMAND`` (also installed as ``dsv4-backend``).

Each command is a subparser whose ``run`` default takes the parsed arguments and returns the
exit status; add a command by adding an ``_add_*_command`` function to :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dsv4_backend.errors import ConfigError, DSV4Error
from dsv4_backend.tools.ab.cli import OneLineErrorParser, add_ab_parser
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
    _add_self_check_command(commands)
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


def _add_self_check_command(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "self-check",
        help="judge every op's preferred kernel against its torch twin on this device",
        description=(
            "The start-up self-check a backend runs on CUDA (docs/self-check.md), by hand: each "
            "op's variants in preference order on a small synthetic case, judged against the "
            "torch twin; the first that passes is the op's default here. On the CPU it checks "
            "the Triton interpreter's variants. Exit status 0 when every variant judged "
            "passed, 1 when one failed (the op then runs the next), 3 with nothing to check."
        ),
    )
    check.add_argument("--device", help="cuda:0 where a GPU is visible, else cpu")
    check.add_argument(
        "--widths",
        choices=("tiny", "flash"),
        help="the synthetic model's widths: tiny (the CPU's default) or DeepSeek-V4-Flash's "
        "(a GPU's default)",
    )
    check.add_argument("--fmt", choices=("fp8", "dense"), default="fp8", help="cache format")
    check.add_argument(
        "--op",
        action="append",
        dest="ops",
        metavar="OP",
        help="decide only this op (repeatable; the others run their torch twin in the check)",
    )
    check.add_argument(
        "--force", action="store_true", help="run it even where its verdicts are cached"
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(run=_run_self_check)


def _run_self_check(args: argparse.Namespace) -> int:
    """Run the self-check (the interpreter on the CPU: set before Triton is imported)."""
    import dataclasses
    import json
    import os

    from dsv4_backend import envs

    if (args.device or "").startswith("cuda") or "triton" in sys.modules:
        pass
    elif envs.TRITON_INTERPRET.get() != "1":
        os.environ[envs.TRITON_INTERPRET.name] = "1"
    import torch

    from dsv4_backend.self_check.check import CHECKED, PRESETS, self_check

    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is visible to torch")
    preset = args.widths or ("flash" if device.type == "cuda" else "tiny")
    widths = dataclasses.replace(PRESETS[preset], fmt=args.fmt)
    tables = {table.op: table for table in CHECKED}
    unknown = sorted(set(args.ops or ()) - set(tables))
    if unknown:
        raise ConfigError(f"--op {', '.join(unknown)}: expected one of {tuple(tables)}")
    ops = None if args.ops is None else [tables[op] for op in args.ops]
    report = self_check(widths, device, use_cache=not args.force, ops=ops)
    print(json.dumps(report.as_json(), indent=2) if args.json else "\n".join(report.lines()))
    if not report.verdicts:
        return 3
    return 1 if report.failed else 0


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
