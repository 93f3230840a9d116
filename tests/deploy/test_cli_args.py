"""The chart's and compose's command lines parse with the real `dspark` CLI parser."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io

import pytest
import yaml

from chart_objects import deployments, main_container
from chart_render import REPO


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    try:
        main = importlib.import_module("dspark_cli.main")
    except ImportError:
        pytest.skip("dspark serve not built yet")
    build = getattr(main, "build_parser", None)
    if build is None:
        pytest.skip("dspark serve not built yet")
    parser = build()
    serve = _subcommands(parser).get("serve")
    if serve is None or not {"scheduler", "verifier", "drafter"} <= set(_subcommands(serve)):
        pytest.skip("dspark serve not built yet")
    return parser


def _parse_error(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """None when `dspark <argv>` parses, else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit:  # argparse reports on stderr and exits 2
        return err.getvalue().strip().splitlines()[-1]
    return None


def test_chart_container_args_parse(parser, case):
    name, _, _, objs = case
    errors = []
    for d in deployments(objs, dspark_only=True):
        args = main_container(d)["args"]
        if (error := _parse_error(parser, args)) is not None:
            errors.append(f"{d['metadata']['name']}: `dspark {' '.join(args)}` -> {error}")
    assert not errors, f"{name}:\n" + "\n".join(errors)


@pytest.mark.parametrize("service", ["scheduler", "verifier", "drafter"])
def test_compose_commands_parse(parser, service):
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    command = compose["services"][service]["command"]
    assert command[0] == "dspark"
    error = _parse_error(parser, command[1:])
    assert error is None, f"`{' '.join(command)}` -> {error}"
