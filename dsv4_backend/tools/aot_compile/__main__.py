"""``python -m dsv4_backend.tools.aot_compile``: one JSON report a configuration and target
(the package docstring)."""

from __future__ import annotations

import argparse
import json
import sys

from dsv4_backend.tools.aot_compile import roofline, toolchain


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dsv4_backend.tools.aot_compile",
        description="Compile the kernels ahead of time for sm_90a / sm_100a and report them.",
    )
    parser.add_argument(
        "--target",
        action="append",
        choices=sorted(toolchain.TARGETS),
        help="repeatable (default: each configuration's own)",
    )
    parser.add_argument(
        "only",
        nargs="*",
        help="configuration name substrings, TARGET:NAME for one target only (default: all)",
    )
    opts = parser.parse_args(argv)
    for report in roofline.reports(opts.only, opts.target or toolchain.TARGETS):
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
