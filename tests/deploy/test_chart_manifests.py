"""Invariants every render of the chart keeps, over the whole values matrix (conftest.MATRIX).

Built-in kinds are validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
unknown fields fail) for the oldest supported Kubernetes and the newest the package knows; CRDs
(KEDA, Prometheus operator) against the subsets in deploy_contract.CRD_SCHEMAS.
"""

from __future__ import annotations

import functools
import re

import jsonschema
import yaml
import pytest
from packaging.version import Version

from chart_objects import (
    DSPARK_COMPONENTS,
    component,
    container_ports,
    deployments,
    env,
    main_container,
    of_kind,
    pod_labels,
    selects,
)
from deploy_contract import CRD_SCHEMAS, parse_serve_args

kubernetes_validate = pytest.importorskip("kubernetes_validate")

MIN_KUBERNETES = "1.30.0"
BUILTIN_KINDS = {
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("v1", "ConfigMap"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
}
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
    "helm.sh/chart",
)


@functools.lru_cache(maxsize=None)
def _k8s_validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """kubernetes_validate.validate(strict=True), with the schema and its 1 MB of definitions loaded once."""
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    mm = utils.major_minor(version)
    schema_version = [v for v in utils.all_versions() if Version(utils.major_minor(v)) <= Version(mm)][-1]
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{schema_version}-local-strict"
    schema = utils.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    definitions = utils.schema_contents(f"{folder}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _kinds(objs):
    return {(o["apiVersion"], o["kind"]) for o in objs}


def test_only_known_kinds_with_unique_names(case):
    name, _, _, objs = case
    unknown = _kinds(objs) - BUILTIN_KINDS - set(CRD_SCHEMAS)
    assert not unknown, f"{name}: kinds without a schema check: {unknown}"
    keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), f"{name}: duplicate objects {keys}"
    for o in objs:
        assert o["metadata"]["namespace"] == "inference", f"{o['kind']}/{o['metadata']['name']} has no namespace"
        if o["kind"] in ("Service", "Deployment"):
            assert len(o["metadata"]["name"]) <= 63


@pytest.mark.parametrize("version", [MIN_KUBERNETES, kubernetes_validate.latest_version()])
def test_builtin_objects_validate_against_kubernetes_schemas(case, version):
    name, _, _, objs = case
    checked = 0
    for o in objs:
        if (o["apiVersion"], o["kind"]) in BUILTIN_KINDS:
            error = jsonschema.exceptions.best_match(_k8s_validator(version, o["apiVersion"], o["kind"]).iter_errors(o))
            if error is not None:
                path = ".".join(str(p) for p in error.path)
                pytest.fail(f"{name}: {o['kind']}/{o['metadata']['name']} invalid for Kubernetes {version} at {path}: {error.message}")
            checked += 1
    assert checked >= 5


def test_crd_objects_match_their_schemas(case):
    name, _, _, objs = case
    for o in objs:
        schema = CRD_SCHEMAS.get((o["apiVersion"], o["kind"]))
        if schema is not None:
            try:
                jsonschema.validate(o, schema)
            except jsonschema.ValidationError as e:
                pytest.fail(f"{name}: {o['kind']}/{o['metadata']['name']} at {list(e.path)}: {e.message}")


def test_objects_carry_standard_labels(case):
    name, _, _, objs = case
    for o in objs:
        labels = o["metadata"].get("labels", {})
        missing = [k for k in STANDARD_LABELS if k not in labels]
        assert not missing, f"{name}: {o['kind']}/{o['metadata']['name']} lacks labels {missing}"
        assert labels["app.kubernetes.io/instance"] == "dspark"
    for d in deployments(objs):
        assert component(d) in DSPARK_COMPONENTS + ("redis",)
        assert pod_labels(d)["app.kubernetes.io/component"] == component(d)


def test_deployment_selectors_match_their_pod_labels(case):
    name, _, _, objs = case
    deps = deployments(objs)
    assert deps, f"{name}: no Deployment rendered"
    for d in deps:
        selector = d["spec"]["selector"]["matchLabels"]
        assert "app.kubernetes.io/component" in selector
        assert selects(selector, pod_labels(d)), f"{name}: {d['metadata']['name']} selector {selector} misses its pods"
        others = [o for o in deps if o is not d and selects(selector, pod_labels(o))]
        assert not others, f"{name}: {d['metadata']['name']} selector also matches {[o['metadata']['name'] for o in others]}"


def test_each_service_selects_one_deployment_whose_ports_it_targets(case):
    name, _, _, objs = case
    for svc in of_kind(objs, "Service"):
        matched = [d for d in deployments(objs) if selects(svc["spec"]["selector"], pod_labels(d))]
        assert len(matched) == 1, f"{name}: Service {svc['metadata']['name']} selects {len(matched)} Deployments"
        ports = container_ports(matched[0])
        for p in svc["spec"]["ports"]:
            target = p["targetPort"]
            assert target in ports or target in ports.values(), f"{name}: Service {svc['metadata']['name']} targets missing port {target}"


def _probe_port(probe: dict):
    for handler in ("grpc", "tcpSocket", "httpGet"):
        if handler in probe:
            return handler, probe[handler]["port"]
    cmd = probe.get("exec", {}).get("command", [])
    if cmd[:3] == ["python3", "-m", "services.common.probe"] and "--port" in cmd:  # the gRPC health check over TLS
        return "grpc", int(cmd[cmd.index("--port") + 1])
    raise AssertionError(f"probe without a handler: {probe}")


def test_probes_reference_existing_container_ports(case):
    name, _, _, objs = case
    for d in deployments(objs):
        ports = container_ports(d)
        for c in d["spec"]["template"]["spec"]["containers"]:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c:
                    _, port = _probe_port(c[kind])
                    assert port in ports or port in ports.values(), f"{name}: {c['name']} {kind} port {port} not in {ports}"


def test_dspark_containers_use_native_grpc_probes_with_a_startup_probe(case):
    name, values, _, objs = case
    for d in deployments(objs, dspark_only=True):
        c = main_container(d)
        grpc_port = container_ports(d)["grpc"]
        # native grpc probes; with tls.enabled the same health check over TLS (kubelet's grpc probes are plaintext)
        assert _probe_port(c["startupProbe"]) == ("grpc", grpc_port)
        assert _probe_port(c["readinessProbe"]) == ("grpc", grpc_port)
        assert ("grpc" in c["readinessProbe"]) != bool(values.get("tls", {}).get("enabled"))
        liveness_off = values.get(component(d), {}).get("probes", {}).get("liveness", {}).get("enabled") is False
        assert ("livenessProbe" not in c) == liveness_off
        budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        if component(d) == "verifier":
            assert budget >= 600, f"{name}: verifier startup probe allows only {budget}s for model load"


def test_network_policies_and_service_monitors_reference_existing_ports(case):
    name, _, _, objs = case
    for np in of_kind(objs, "NetworkPolicy"):
        matched = [d for d in deployments(objs) if selects(np["spec"]["podSelector"]["matchLabels"], pod_labels(d))]
        assert len(matched) == 1, f"{name}: NetworkPolicy {np['metadata']['name']} selects {len(matched)} Deployments"
        ports = set(container_ports(matched[0]).values())
        for rule in np["spec"]["ingress"]:
            for p in rule["ports"]:
                assert p["port"] in ports, f"{name}: NetworkPolicy {np['metadata']['name']} opens unused port {p['port']}"
    for sm in of_kind(objs, "ServiceMonitor"):
        svcs = [s for s in of_kind(objs, "Service")
                if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(svcs) == 1, f"{name}: ServiceMonitor {sm['metadata']['name']} selects {len(svcs)} Services"
        names = {p["name"] for p in svcs[0]["spec"]["ports"]}
        assert all(e["port"] in names for e in sm["spec"]["endpoints"])


def test_pdbs_select_one_deployment(case):
    name, _, _, objs = case
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        matched = [d for d in deployments(objs) if selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(d))]
        assert len(matched) == 1, f"{name}: PDB {pdb['metadata']['name']} selects {len(matched)} Deployments"


def test_pods_are_hardened(case):
    name, _, _, objs = case
    for d in deployments(objs):
        spec = d["spec"]["template"]["spec"]
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True
        assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod_sc["runAsUser"] != 0
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            where = f"{name}: {d['metadata']['name']}/{c['name']}"
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in sc["capabilities"], where
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{where} mounts undefined volume {m['name']}"
        if component(d) in DSPARK_COMPONENTS:
            tmp = [m for m in main_container(d)["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{name}: {d['metadata']['name']} has no emptyDir /tmp"
            wants_token = component(d) == "scheduler" and spec["automountServiceAccountToken"]
            assert spec["automountServiceAccountToken"] is wants_token


def test_dspark_containers_follow_the_serve_contract(case):
    name, _, _, objs = case
    for d in deployments(objs, dspark_only=True):
        c = main_container(d)
        assert c["command"] == ["dspark"]
        comp, flags = parse_serve_args(c["args"])
        assert comp == component(d)
        ports = container_ports(d)
        assert int(flags["--port"]) == ports["grpc"]
        assert int(flags["--metrics-port"]) == ports["metrics"]
        if comp == "scheduler":
            assert int(flags["--http-port"]) == ports["http"]
        e = env(c)
        assert flags["--redis-url"] == "$(REDIS_URL)" and "value" in e["REDIS_URL"]
        assert e["DSPARK_POD_ADDRESS"]["value"] == f"$(POD_IP):{ports['grpc']}"
        assert e["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        # $(VAR) references only resolve to variables defined earlier in the list
        order = [x["name"] for x in c["env"]]
        assert order.index("POD_IP") < order.index("DSPARK_POD_ADDRESS")


def test_autoscaled_pools_leave_replicas_to_their_scaler(case):
    name, _, _, objs = case
    scalers = of_kind(objs, "HorizontalPodAutoscaler") + of_kind(objs, "ScaledObject")
    builtin = any("--autoscale" in main_container(d)["args"] for d in deployments(objs, dspark_only=True))
    scaled = {s["spec"]["scaleTargetRef"]["name"] for s in scalers}
    for s in scalers:
        assert s["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert s["spec"]["scaleTargetRef"]["name"] in {d["metadata"]["name"] for d in deployments(objs)}
    for d in deployments(objs, dspark_only=True):
        pool = component(d) in ("drafter", "verifier")
        autoscaled = pool and (scalers or builtin)
        assert ("replicas" not in d["spec"]) == bool(autoscaled), f"{name}: {d['metadata']['name']} replicas vs autoscaling"
        if scalers and pool:
            assert d["metadata"]["name"] in scaled


def test_one_template_file_per_object_kind_per_component(case):
    name, _, rendered, _ = case
    owner: dict[tuple[str, str | None], str] = {}
    for path, text in rendered.items():
        if path.endswith("NOTES.txt"):
            continue
        docs = [d for d in yaml.safe_load_all(text) if d]
        kinds = {(d["kind"], component(d)) for d in docs}
        assert len(kinds) <= 1 and len(docs) == len(kinds), f"{name}: {path} renders {len(docs)} objects: {kinds}"
        for key in kinds:
            assert key not in owner, f"{name}: {key} rendered by both {owner[key]} and {path}"
            owner[key] = path
