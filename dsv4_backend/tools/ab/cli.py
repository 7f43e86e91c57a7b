"""``python -m dsv4_backend ab``: replay a serving trace through backends A and B.

``add_ab_parser(subparsers)`` adds the command (its ``run`` default is :func:`run_ab`);
``main(argv)`` runs it standalone. Exit status: 0 when every mode is within tolerance, 1 when
one is not (or a backend raised), 2 for bad input (unknown backend, a config without
DeepSeek-V4 fields, an unusable device, ...), reported as one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

# Light imports only: the lead's parser adds this command for every ``dsv4-backend`` call;
# torch and the A/B modules load when ``ab`` runs.
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError, DSV4Error
from dsv4_backend.hf_config import config_from_hf
from dsv4_backend.tools.cpu_server.ab_server import add_server_options

if TYPE_CHECKING:
    import torch

#: Longest request a trace may hold: the simulated pool and the reference grow with it.
MAX_TRACE_LEN = 1 << 16

DESCRIPTION = """\
Replay one serving trace through backend A and backend B on identical inputs and caches and
compare them per mode (prefill, draft, verify, draft_extend, decode; each on the eager and
the graph path): max absolute and relative error and cosine similarity of the outputs,
planning and kernel time of each backend (median, p90) and their ratio. Writes report.md,
report.json and times.png to --out. Exit status 0: every mode within tolerance; 1: a mode over
tolerance or a backend failed; 2: bad input.

Backends: dsv4 (this package, default kernel dispatch: Triton on CUDA, the Triton interpreter
with TRITON_INTERPRET=1, torch otherwise), dsv4-torch (torch kernels forced), dsv4-fp8 (dsv4
with sglang's FP8 caches), reference (the plain torch reference), sglang:<name> (an
sglang-registered attention backend, e.g. sglang:dsv4_builtin; CUDA only).
"""


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, exit status 2:
    ``<error_prefix>: error: <message>`` (the form of the tool's other input errors)."""

    def __init__(self, *args: object, error_prefix: str | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.error_prefix = error_prefix or self.prog

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.error_prefix}: error: {message}\n")


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a", default="dsv4", metavar="NAME", help="backend A (default dsv4)")
    parser.add_argument(
        "--b", metavar="NAME", help="backend B (default reference; with --server dsv4-torch)"
    )
    trace = parser.add_argument_group("trace")
    trace.add_argument("--requests", type=int, default=3, help="requests (default 3)")
    trace.add_argument(
        "--max-len",
        type=int,
        default=300,
        help="longest request, prompt plus generated tokens (default 300)",
    )
    trace.add_argument(
        "--cycles",
        type=int,
        help="speculative rounds: draft, verify, draft extend (default 4; 0 with --v41)",
    )
    trace.add_argument("--decode-steps", type=int, default=4, help="decodes (default 4)")
    trace.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        metavar="N",
        help="these prompt lengths, one request each, instead of --requests drawn ones",
    )
    trace.add_argument("--seed", type=int, default=0, help="lengths, drafts and data (default 0)")
    trace.add_argument(
        "--dp-pad",
        type=int,
        default=0,
        metavar="N",
        help="DP attention scenario: N padding requests (pool row 0, seq_len 1, slot 0) join "
        "every draft, verify and decode batch before planning (default 0)",
    )
    trace.add_argument(
        "--prefix-share",
        action="store_true",
        help="one more request shares request 0's prompt and starts from its cached pages "
        "(a radix-cache hit of whole 256-token pages)",
    )
    trace.add_argument(
        "--spec",
        choices=("eagle", "dspark"),
        default="eagle",
        help="speculative rounds: EAGLE (draft steps, verify, draft extend) or DSpark (a draft "
        "block through the draft head's window-only stages, then the verify) (default eagle)",
    )
    trace.add_argument(
        "--bounded-replay",
        action="store_true",
        help="DeepSeek-V4.1's decoder SWA bounded replay on both sides: a prefill's late "
        "layers run over its late-layer tail (each request's last 128 rows)",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="a DeepSeek-V4 config.json for real dimensions (default: the tiny configuration)",
    )
    model.add_argument(
        "--v41",
        action="store_true",
        help="the tiny DeepSeek-V4.1 configuration (prefills and decodes; a V4.1 --config is "
        "read as V4.1 already)",
    )
    model.add_argument(
        "--layers",
        metavar="IDS",
        help="comma-separated layer ids to simulate (default: all layers of the tiny "
        "configuration; with --config, the first layer of each compress ratio)",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    run.add_argument(
        "--atol",
        action="append",
        default=[],
        metavar="[MODE=]VALUE",
        help="absolute tolerance for every mode, a mode (verify=2e-4) or a mode/path "
        "(verify/graph=2e-4); repeatable (default 1e-4 on cpu, 0.047 on cuda: bf16 dot operands; "
        "dense vs FP8 caches: 1.0, and the median row error within e4m3's u/sqrt(3))",
    )
    run.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: fastest for these small ops on a shared machine; "
        "0 keeps torch's default)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--out",
        type=Path,
        default=Path("ab-report"),
        help="folder for report.md, report.json and times.png (default ./ab-report)",
    )
    out.add_argument("--json", action="store_true", help="print the JSON report to stdout")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    add_server_options(parser)


def add_ab_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``ab`` command to ``subparsers``; its ``run`` default is :func:`run_ab`."""
    parser = subparsers.add_parser(
        "ab",
        help="compare two attention backends on one serving trace",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if isinstance(parser, OneLineErrorParser):  # the parent is the package's parser
        parser.error_prefix = "dsv4-backend ab"
    _add_options(parser)
    parser.set_defaults(run=run_ab)
    return parser


def _device(name: str | None) -> torch.device:
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; expected cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r}: expected cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                f"{torch.cuda.device_count()} GPUs visible); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {name}: only {torch.cuda.device_count()} CUDA devices are visible"
            )
    return device


def _config(path: Path | None, layers: str | None, v41: bool = False) -> DSV4AttentionConfig:
    """The tiny configuration (DeepSeek-V4.1's with ``v41``) or ``path``'s, restricted to
    ``layers`` (a DeepSeek-V4.1 model runs every layer: its layers share caches)."""
    from dataclasses import replace

    from dsv4_backend.testing.simulation.v41 import tiny_v41

    if v41:
        if path is not None or layers is not None:
            raise ConfigError(
                "--v41 is the tiny DeepSeek-V4.1 configuration: leave out --config (a V4.1 "
                "config.json is read as V4.1) and --layers"
            )
        return tiny_v41()
    if path is None:
        config = DSV4AttentionConfig.tiny(speculative=True)
        ids = list(range(len(config.compress_ratios)))
    else:
        try:
            hf = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config {path}: not a JSON file ({exc})") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"--config {path}: expected a JSON object, got {type(hf).__name__}")
        try:
            config = config_from_hf(hf, speculative=True)
        except (ValueError, TypeError) as exc:  # ConfigError, or a field of the wrong type
            raise ConfigError(f"--config {path}: {exc}") from None
        ratios = config.compress_ratios
        ids = sorted({ratios.index(r) for r in ratios})
        if config.v41 is not None:
            if layers is not None:
                raise ConfigError(
                    f"--layers {layers!r}: a DeepSeek-V4.1 model runs every layer (its layers "
                    "share the kv and index sources' caches)"
                )
            return config
    if layers is not None:
        try:
            ids = [int(i) for i in layers.split(",")]
        except ValueError:
            raise ConfigError(f"--layers {layers!r}: expected comma-separated layer ids") from None
        count = len(config.compress_ratios)
        bad = [i for i in ids if not 0 <= i < count]
        if bad or not ids:
            raise ConfigError(f"--layers {layers!r}: layer ids must be in 0 ... {count - 1}")
    return replace(config, compress_ratios=tuple(config.compress_ratios[i] for i in ids))


def _atol(values: list[str]) -> dict[str, float]:
    """``["1e-4", "verify=2e-4"]`` -> ``{"*": 1e-4, "verify": 2e-4}``."""
    from dsv4_backend.tools.ab.runner import check_atol_keys
    from dsv4_backend.tools.ab.trace import MODES

    out = {}
    for value in values:
        key, _, number = value.rpartition("=")
        try:
            tolerance = float(number)
        except ValueError:
            raise ConfigError(f"--atol {value!r}: expected [MODE=]NUMBER") from None
        if not math.isfinite(tolerance) or tolerance < 0:
            raise ConfigError(f"--atol {value!r}: the tolerance must be a finite number >= 0")
        out[key or "*"] = tolerance
    unknown = check_atol_keys(out)
    if unknown:
        raise ConfigError(
            f"--atol names {unknown}; expected a mode ({', '.join(MODES)}) or mode/path "
            "(e.g. verify/graph)"
        )
    return out


#: Written into ``--out`` and removed again before the run, to prove the folder is writable.
PROBE_FILE = ".dsv4-ab-write-probe"


def _prepare_out(out: Path) -> None:
    """Make ``--out`` and write a probe file into it, before the run rather than after it.

    Writing is the only reliable test: ``os.access`` answers yes to root even where the file
    system refuses (``/proc``, ``/sys``, a read-only mount).
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"--out {out}: {parent} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / PROBE_FILE
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write a report there ({_reason(exc)})") from None


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _check_max_len(max_len: int) -> None:
    if max_len > MAX_TRACE_LEN:
        raise ConfigError(
            f"--max-len {max_len}: expected at most {MAX_TRACE_LEN} (the trace keeps every "
            "request's data and reference in memory)"
        )


def run_ab(args: argparse.Namespace) -> int:
    """Run the ``ab`` command from parsed arguments; return the exit status."""
    import torch

    from dsv4_backend import envs
    from dsv4_backend.kernels.dispatch import interpreter_enabled
    from dsv4_backend.planning.checks import strict_checks
    from dsv4_backend.testing.interpreter import patch_language_once
    from dsv4_backend.tools.ab.backends import make_backend
    from dsv4_backend.tools.ab.report import build_report, render_markdown, write_report
    from dsv4_backend.tools.ab.runner import run_trace
    from dsv4_backend.tools.ab.trace import build_trace

    if args.server:
        return _run_server_ab(args)
    args.b = args.b or "reference"
    if interpreter_enabled():
        patch_language_once()
    try:
        _check_max_len(args.max_len)
        device = _device(args.device)
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        a = make_backend(args.a, device)
        b = make_backend(args.b, device)
        config = _config(args.config, args.layers, args.v41)
        atol = _atol(args.atol)
        cycles = args.cycles if args.cycles is not None else 0 if config.v41 else 4
        trace = build_trace(
            config,
            num_requests=args.requests,
            max_len=args.max_len,
            cycles=cycles,
            decode_steps=args.decode_steps,
            seed=args.seed,
            dp_pad=args.dp_pad,
            prefix_share=args.prefix_share,
            spec=args.spec,
            bounded_replay=args.bounded_replay,
            prompt_lens=args.prompt_lens,
        )
        _prepare_out(args.out)  # the last check: a refused run leaves no folder behind
        # Strict mode (planning/checks.py) unless DSV4_STRICT_CHECKS=0: a bad batch raises at
        # once, against its mode.
        strict = not envs.STRICT_CHECKS.is_set() or envs.STRICT_CHECKS.get() == "1"
        with strict_checks(strict):
            result = run_trace(trace, a, b, device=device, atol=atol, progress=not args.quiet)
    except DSV4Error as exc:
        print(f"dsv4-backend ab: error: {exc}", file=sys.stderr)
        return 2
    report = build_report(result)
    try:
        paths = write_report(report, args.out)
    except OSError as exc:  # the folder was writable before the run (disk full, removed, ...)
        print(f"dsv4-backend ab: error: --out {args.out}: {_reason(exc)}", file=sys.stderr)
        return 2
    if "plot" not in paths:
        print(
            "dsv4-backend ab: matplotlib is not installed (in the checkout: pip install -e "
            "'.[report]'); no plot written",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render_markdown(report).rsplit("\n![", 1)[0])
        print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")
    return 0 if result.passed else 1


def _run_server_ab(args: argparse.Namespace) -> int:
    """``ab --server``: two sglang servers on the same prompts (``tools/cpu_server/ab_server``)."""
    from dsv4_backend.tools.cpu_server import ab_server

    args.b = args.b or "dsv4-torch"
    try:
        device = _device(args.device).type
        _prepare_out(args.out)
        report, status = ab_server.run_server_ab(args, device)
    except DSV4Error as exc:
        print(f"dsv4-backend ab: error: {exc}", file=sys.stderr)
        return 2
    paths = ab_server.write_report(report, args.out)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(ab_server.render_markdown(report))
        print(f"written: {', '.join(str(p) for p in paths)}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ab`` standalone: ``main(["--requests", "2"])``."""
    parser = OneLineErrorParser(
        prog="python -m dsv4_backend ab",
        error_prefix="dsv4-backend ab",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_options(parser)
    return run_ab(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
