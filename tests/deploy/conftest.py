"""Fixtures for the deployment tests: the chart, and each entry of the values matrix rendered once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The helper modules beside this file (chart_render, chart_objects, deploy_contract, values_doc),
# whatever the import mode pytest runs with.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chart_render import CHART_DIR, MATRIX, manifests, render  # noqa: E402

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[dev]')")


@pytest.fixture(scope="session")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


_CASES: dict[str, tuple] = {}


@pytest.fixture(scope="session", params=sorted(MATRIX))
def case(request, chart):
    """(name, values, rendered templates, objects) of one matrix entry, rendered and parsed once.

    Tests must not mutate what they get: it is shared.
    """
    name = request.param
    if name not in _CASES:
        rendered = render(chart, MATRIX[name])
        _CASES[name] = (name, MATRIX[name], rendered, manifests(rendered))
    return _CASES[name]


@pytest.fixture(scope="session")
def objects(chart):
    """matrix name -> its rendered objects (the same cache as `case`)."""

    def get(name: str) -> list[dict]:
        if name not in _CASES:
            rendered = render(chart, MATRIX[name])
            _CASES[name] = (name, MATRIX[name], rendered, manifests(rendered))
        return _CASES[name][3]

    return get
