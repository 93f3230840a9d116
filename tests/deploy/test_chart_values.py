"""values.yaml, values.schema.json, README.md and `helm lint` agree with each other."""

from __future__ import annotations

import json

import pytest
import yaml

import values_doc
from chart_render import CHART_DIR, MATRIX

helm = pytest.importorskip("helm_python")

VALUES_TEXT = (CHART_DIR / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
COMPONENTS = ("scheduler", "verifier", "drafter")
# Keys that only make sense for one component; everything else is common to the three blocks.
OWN_KEYS = {"scheduler": {"policy", "autoscaler", "servedModelName", "calibrationBound", "collapseRatio",
                          "draftWindow", "slotCorrection", "draftGateScope", "lookupNgram", "maxRequestsPerClient"},
            "verifier": {"device", "dtype", "weights", "kvCacheGb", "idleTtlSeconds", "spsProfileSeconds"},
            "drafter": {"device", "dtype", "matmulDtype", "besideVerifier"}}


def _lint_problems(report: dict) -> list[dict]:
    """Lint messages at warning (2) or error (3) severity."""
    return [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_helm_lint_strict_is_clean(name):
    report = helm.lint(CHART_DIR, MATRIX[name], strict=True, kube_version="v1.30.0")
    assert report["total_charts_linted"] == 1
    assert not _lint_problems(report), report


def test_chart_metadata():
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2" and meta["name"] == "dspark" and meta["type"] == "application"
    assert meta["kubeVersion"].startswith(">=1.30")


@pytest.mark.parametrize("values, where", [
    ({"drafter": {"replicaCount": -1}}, "/drafter/replicaCount"),
    ({"verifier": {"replicaCont": 2}}, "replicaCont"),
    ({"scheduler": {"service": {"ports": {"grpc": 70000}}}}, "/scheduler/service/ports/grpc"),
    ({"verifier": {"service": {"ports": {"http": 8000}}}}, "http"),
    ({"models": {"source": "s3"}}, "/models/source"),
    ({"verifier": {"device": "gpu"}}, "/verifier/device"),
    ({"redis": {"external": {"url": "http://redis:6379"}}}, "/redis/external/url"),
    ({"autoscaling": {"keda": {"trigger": "cpu"}}}, "/autoscaling/keda/trigger"),
    ({"autoscaling": {"drafter": {"minReplicas": 0}}}, "/autoscaling/drafter/minReplicas"),
    ({"verifier": {"probes": {"startup": {"enabled": "yes"}}}}, "/verifier/probes/startup/enabled"),
    ({"drafter": {"podDisruptionBudget": {"maxUnavailable": "half"}}}, "/drafter/podDisruptionBudget/maxUnavailable"),
    ({"unknownTopLevel": True}, "unknownTopLevel"),
])
def test_schema_rejects_bad_values(chart, values, where):
    with pytest.raises(helm.HelmValuesError) as info:
        chart.validate_schema(values)
    assert where in str(info.value)
    with pytest.raises(helm.HelmError):
        chart.render(values, name="dspark", namespace="inference")


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_schema_accepts_the_matrix(chart, name):
    chart.validate_schema(MATRIX[name])


def _subschema(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _schema_paths(schema: dict, node: dict, prefix: str = "") -> set[str]:
    """Dotted paths of every property the schema closes (additionalProperties: false)."""
    node = _subschema(schema, node)
    paths = set()
    for key, child in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        resolved = _subschema(schema, child)
        if resolved.get("additionalProperties") is False:
            paths |= _schema_paths(schema, resolved, path + ".")
    return paths


def _value_paths(values: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in values.items():
        paths.add(f"{prefix}{key}")
        if isinstance(value, dict):
            paths |= _value_paths(value, f"{prefix}{key}.")
    return paths


def test_schema_is_in_step_with_values_yaml():
    schema_paths = _schema_paths(SCHEMA, SCHEMA) - {"global"}
    value_paths = _value_paths(VALUES)
    documented = {v.path for v in values_doc.documented_values(VALUES_TEXT)[0]}
    # every value has a schema entry ...
    closed_parents = {p.rsplit(".", 1)[0] for p in schema_paths if "." in p} | {""}
    missing = {p for p in value_paths if p not in schema_paths and (p.rsplit(".", 1)[0] if "." in p else "") in closed_parents}
    assert not missing, f"values.yaml keys missing from values.schema.json: {sorted(missing)}"
    # ... and every schema property exists in values.yaml (so it is documented with a default)
    stale = {p for p in schema_paths if p not in value_paths}
    assert not stale, f"values.schema.json properties absent from values.yaml: {sorted(stale)}"
    assert documented <= value_paths


def test_every_value_is_documented_by_a_comment():
    values, undocumented = values_doc.documented_values(VALUES_TEXT)
    assert not undocumented, f"values without a `# --` comment: {undocumented}"
    assert all(len(v.description) >= 10 for v in values)


def test_readme_values_table_is_up_to_date():
    readme = (CHART_DIR / "README.md").read_text()
    assert readme == values_doc.render_readme(readme, VALUES_TEXT), "run: python tests/deploy/values_doc.py --write"


def _shape(value):
    """Key tree of a value (leaves collapse to their type)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__


def test_component_blocks_share_one_shape():
    common = {c: {k: v for k, v in VALUES[c].items() if k not in OWN_KEYS[c]} for c in COMPONENTS}
    assert set(common["scheduler"]) == set(common["verifier"]) == set(common["drafter"])
    for c in ("verifier", "drafter"):
        for key in common[c]:
            a, b = _shape(common["scheduler"][key]), _shape(common[c][key])
            if key == "service":  # the scheduler serves HTTP too
                a["ports"].pop("http")
            assert a == b, f"{c}.{key} differs in shape from scheduler.{key}"
    for c in COMPONENTS:
        assert set(VALUES[c]) >= {"image", "replicaCount", "resources", "probes", "enabled", "extraEnv", "extraArgs",
                                  "nodeSelector", "tolerations", "affinity", "runtimeClassName", "podAnnotations", "service"}
        assert set(VALUES[c]["probes"]) == {"startup", "readiness", "liveness"}
        assert all(p["enabled"] is True for p in VALUES[c]["probes"].values())
