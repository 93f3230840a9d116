"""The `dspark` command: one entry point, one module per subcommand.

Argument parsing, environment and exit codes live here and in the subcommand modules, never in
dspark_core. Every expected failure (bad input, missing model, full context) becomes one line on stderr
and exit code 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import sys

from dspark_core.errors import DSparkError


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit 2, like our own errors."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from . import bench, calibrate, certs, client, generate, models_cmd, profile, report, serve, train
    from . import eval as eval_cmd

    parser = _Parser(prog="dspark", description="DSpark: confidence-scheduled speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for module in (generate, train, calibrate, eval_cmd, report, profile, bench, serve, client, models_cmd, certs):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DSparkError as exc:
        print(f"dspark {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
