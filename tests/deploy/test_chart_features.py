"""What each deployment shape of the chart renders: autoscaling, Redis, models, GPUs, observability."""

from __future__ import annotations

import json

import pytest

from chart_objects import component, deployment_of, deployments, env, main_container, named, of_kind
from chart_render import MATRIX, manifests, render

helm = pytest.importorskip("helm_python")


def _render_error(chart, values: dict) -> str:
    with pytest.raises(helm.HelmError) as info:
        render(chart, values)
    return str(info.value)


# ---------------------------------------------------------------------------- autoscaling


def test_keda_prometheus_scales_each_pool_on_its_desired_replicas(objects):
    objs = objects("keda-prometheus")
    scaled = {so["spec"]["scaleTargetRef"]["name"]: so for so in of_kind(objs, "ScaledObject")}
    assert set(scaled) == {"dspark-verifier", "dspark-drafter"}
    for pool, bounds in (("drafter", (1, 8, 0, 300)), ("verifier", (1, 4, 60, 600))):
        spec = scaled[f"dspark-{pool}"]["spec"]
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == bounds[:2]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == bounds[2]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == bounds[3]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert meta["serverAddress"] == "http://prometheus-operated.monitoring:9090"
        assert meta["query"] == f'max(dspark_desired_replicas{{namespace="inference",pool="{pool}"}})'
        assert meta["threshold"] == "1"
    assert not of_kind(objs, "HorizontalPodAutoscaler") and not of_kind(objs, "TriggerAuthentication")


def test_keda_redis_trigger_reads_the_pool_key_with_the_release_password(objects):
    objs = objects("keda-redis-auth")
    auth = named(objs, "TriggerAuthentication", "dspark-redis-auth")
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "dspark-redis", "key": "redis-password"}]
    for so in of_kind(objs, "ScaledObject"):
        pool = component(so)
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "redis"
        assert trigger["metadata"] == {
            "address": "dspark-redis:6379",
            "listName": f"dspark:autoscale:replicas:{pool}",
            "listLength": "1",
            "databaseIndex": "0",
            "enableTLS": "false",
        }
        assert trigger["authenticationRef"] == {"name": "dspark-redis-auth"}
    redis = main_container(deployment_of(objs, "redis"))
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert env(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "dspark-redis", "key": "redis-password"}
    keda_peer = MATRIX["keda-redis-auth"]["networkPolicy"]["redisExtraFrom"][0]
    assert keda_peer in named(objs, "NetworkPolicy", "dspark-redis")["spec"]["ingress"][0]["from"]


@pytest.mark.parametrize("name, metric_type", [("hpa-external", "External"), ("hpa-object", "Object")])
def test_hpa_reads_the_desired_replicas_metric_of_its_pool(objects, name, metric_type):
    objs = objects(name)
    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {"dspark-verifier", "dspark-drafter"}
    for h in hpas:
        (metric,) = h["spec"]["metrics"]
        assert metric["type"] == metric_type
        body = metric["external" if metric_type == "External" else "object"]
        assert body["metric"] == {"name": "dspark_desired_replicas", "selector": {"matchLabels": {"pool": component(h)}}}
        assert body["target"] == {"type": "AverageValue", "averageValue": "1"}
        if metric_type == "Object":
            assert body["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "dspark-scheduler"}
        assert set(h["spec"]["behavior"]) == {"scaleUp", "scaleDown"}
    assert not of_kind(objs, "ScaledObject")


def test_builtin_scaler_gets_least_privilege_rbac_and_its_targets(objects):
    objs = objects("builtin-scaler")
    scheduler = deployment_of(objs, "scheduler")
    pod = scheduler["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "dspark-scheduler" and pod["automountServiceAccountToken"] is True
    named(objs, "ServiceAccount", "dspark-scheduler")
    role = named(objs, "Role", "dspark-scheduler")
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["dspark-drafter", "dspark-verifier"], "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": ["dspark-drafter", "dspark-verifier"], "verbs": ["get", "patch"]},
    ]
    binding = named(objs, "RoleBinding", "dspark-scheduler")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dspark-scheduler"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dspark-scheduler", "namespace": "inference"}]
    c = main_container(scheduler)
    assert "--autoscale" in c["args"]
    pools = json.loads(env(c)["DSPARK_AUTOSCALE_POOLS"]["value"])
    assert pools["verifier"] == {"deployment": "dspark-verifier", "minReplicas": 1, "maxReplicas": 4,
                                 "scaleUpStabilizationWindowSeconds": 60, "scaleDownStabilizationWindowSeconds": 600}
    assert pools["drafter"]["deployment"] == "dspark-drafter"
    for d in deployments(objs):
        if d is not scheduler:
            assert d["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_no_rbac_and_fixed_replicas_without_autoscaling(objects):
    objs = objects("defaults")
    assert not of_kind(objs, "Role") and not of_kind(objs, "RoleBinding")
    assert not of_kind(objs, "ScaledObject") and not of_kind(objs, "HorizontalPodAutoscaler")
    assert deployment_of(objs, "scheduler")["spec"]["replicas"] == 2
    assert deployment_of(objs, "verifier")["spec"]["replicas"] == 1


# ---------------------------------------------------------------------------- redis


def test_bundled_redis_is_reachable_only_from_dspark_pods(objects):
    objs = objects("defaults")
    for d in deployments(objs, dspark_only=True):
        assert env(main_container(d))["REDIS_URL"]["value"] == "redis://dspark-redis:6379/0"
        assert "REDIS_PASSWORD" not in env(main_container(d))
    policy = named(objs, "NetworkPolicy", "dspark-redis")
    (rule,) = policy["spec"]["ingress"]
    assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in rule["from"]} == {"scheduler", "verifier", "drafter"}


def test_external_redis_replaces_the_bundled_one(objects):
    objs = objects("external-redis")
    assert deployment_of(objs, "redis") is None
    assert not [o for o in objs if component(o) == "redis"]
    for d in deployments(objs, dspark_only=True):
        e = env(main_container(d))
        assert e["REDIS_URL"]["value"] == "rediss://redis.shared.svc:6380/2"
        assert e["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "shared-redis", "key": "password"}
    so = named(objs, "ScaledObject", "dspark-verifier")
    meta = so["spec"]["triggers"][0]["metadata"]
    assert (meta["address"], meta["databaseIndex"], meta["enableTLS"]) == ("redis.shared.svc:6380", "2", "true")


# ---------------------------------------------------------------------------- pods


def test_drafter_and_verifier_networking_admits_only_schedulers_on_grpc(objects):
    objs = objects("defaults")
    for comp, port in (("verifier", 50052), ("drafter", 50053)):
        grpc_rule, metrics_rule = named(objs, "NetworkPolicy", f"dspark-{comp}")["spec"]["ingress"]
        assert grpc_rule["ports"] == [{"port": port, "protocol": "TCP"}]
        assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in grpc_rule["from"]] == ["scheduler"]
        # metrics: the release's own pods unless networkPolicy.metricsFrom says who else scrapes
        assert metrics_rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "dspark"}}}]
        assert named(objs, "Service", f"dspark-{comp}")["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in named(objs, "Service", "dspark-scheduler")["spec"]


def test_gpu_values_reach_the_pods(objects):
    objs = objects("gpu")
    verifier = deployment_of(objs, "verifier")
    pod = verifier["spec"]["template"]["spec"]
    c = main_container(verifier)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["args"][-4:] == ["--device", "cuda", "--dtype", "bfloat16"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    shm = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm == [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    drafter = main_container(deployment_of(objs, "drafter"))
    assert drafter["args"][-2:] == ["--device", "cuda"] and drafter["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(deployment_of(objs, "scheduler"))


def test_default_pods_request_no_gpu_and_pass_no_device(objects):
    for d in deployments(objects("defaults"), dspark_only=True):
        c = main_container(d)
        assert "--device" not in c["args"] and "nvidia.com/gpu" not in str(c["resources"])


def test_extra_args_and_env_are_appended(chart):
    objs = manifests(render(chart, {
        "verifier": {"extraArgs": ["--max-batch-tokens", "8192"], "extraEnv": [{"name": "DSPARK_LOG_LEVEL", "value": "debug"}]},
    }))
    c = main_container(deployment_of(objs, "verifier"))
    assert c["args"][-2:] == ["--max-batch-tokens", "8192"]
    assert c["env"][-1] == {"name": "DSPARK_LOG_LEVEL", "value": "debug"}


def test_drafter_matmul_dtype_reaches_the_drafter_only(chart):
    objs = manifests(render(chart, {"drafter": {"matmulDtype": "float32"}}))
    args = main_container(deployment_of(objs, "drafter"))["args"]
    assert args[args.index("--drafter-matmul-dtype") + 1] == "float32"
    assert "--drafter-matmul-dtype" not in main_container(deployment_of(objs, "verifier"))["args"]
    default_args = main_container(deployment_of(manifests(render(chart, {})), "drafter"))["args"]
    assert "--drafter-matmul-dtype" not in default_args
    assert "matmulDtype" in _render_error(chart, {"drafter": {"matmulDtype": "fp8"}})


def test_component_image_overrides_the_shared_image(chart):
    objs = manifests(render(chart, {"image": {"repository": "registry.example/dspark", "tag": "1.2.3"},
                                    "verifier": {"image": {"tag": "1.2.3-cu128"}}}))
    assert main_container(deployment_of(objs, "verifier"))["image"] == "registry.example/dspark:1.2.3-cu128"
    assert main_container(deployment_of(objs, "drafter"))["image"] == "registry.example/dspark:1.2.3"


# ---------------------------------------------------------------------------- models


def _flag(container: dict, flag: str) -> str | None:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


def test_models_come_from_the_image_by_default(objects):
    objs = objects("defaults")
    scheduler, verifier, drafter = (main_container(deployment_of(objs, c)) for c in ("scheduler", "verifier", "drafter"))
    # the default target (SmolLM2, converted into the image) and its DSpark drafter
    assert _flag(scheduler, "--target") == _flag(verifier, "--target") == _flag(drafter, "--target") \
        == "/app/models/smollm2-135m-instruct"  # tokenizer / target / referenced embedding and LM head
    assert _flag(drafter, "--drafter-path") == _flag(verifier, "--drafter-path") == "/app/models/smollm2/dspark"
    for d in deployments(objs, dspark_only=True):
        assert env(main_container(d))["DSPARK_MODELS_DIR"]["value"] == "/app/models"
        assert "initContainers" not in d["spec"]["template"]["spec"]
        assert not [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]


@pytest.mark.parametrize("name, source_key", [("models-pvc", "persistentVolumeClaim"), ("models-hostpath", "hostPath")])
def test_model_volumes_are_mounted_read_only(objects, name, source_key):
    objs = objects(name)
    for d in deployments(objs, dspark_only=True):
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m for m in main_container(d)["volumeMounts"]}
        assert source_key in volumes["models"]
        assert mounts["models"]["mountPath"] == "/app/models" and mounts["models"]["readOnly"] is True
    verifier = deployment_of(objs, "verifier")
    if name == "models-pvc":
        volume = [v for v in verifier["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"][0]
        assert volume["persistentVolumeClaim"] == {"claimName": "llm-weights", "readOnly": True}
        assert [m for m in main_container(verifier)["volumeMounts"] if m["name"] == "models"][0]["subPath"] == "qwen3"


def test_init_container_fetches_each_pool_its_models(objects):
    objs = objects("models-init")
    expected = {
        "scheduler": ["hf://Qwen/Qwen3-8B@main=/app/models/target|*.json,*.txt,*.model,*.tiktoken,*.jinja"],
        "verifier": ["hf://Qwen/Qwen3-8B@main=/app/models/target", "hf://dspark/qwen3-8b-dspark=/app/models/dspark|config.json"],
        # the drafter checkpoint carries its own embeddings and LM head: it never needs the target
        "drafter": ["hf://dspark/qwen3-8b-dspark=/app/models/dspark",
                    "hf://Qwen/Qwen3-8B@main=/app/models/target|*.json,*.safetensors"],
    }
    for comp, args in expected.items():
        pod = deployment_of(objs, comp)["spec"]["template"]["spec"]
        (fetch,) = pod["initContainers"]
        assert fetch["args"] == args
        assert fetch["command"][:2] == ["python", "-c"] and "snapshot_download" in fetch["command"][2]
        assert env(fetch)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        assert env(fetch)["HF_HUB_OFFLINE"]["value"] == "0"  # the image is offline for the services only
        assert {"name": "models", "mountPath": "/app/models"} in fetch["volumeMounts"]
        models = [v for v in pod["volumes"] if v["name"] == "models"][0]
        assert models["emptyDir"] == {"sizeLimit": "50Gi"}


def test_fetch_script_parses_uris(chart):
    """The init container's script, run here against a stub huggingface_hub."""
    import subprocess
    import sys
    import textwrap

    objs = manifests(render(chart, MATRIX["models-init"]))
    (fetch,) = deployment_of(objs, "verifier")["spec"]["template"]["spec"]["initContainers"]
    stub = textwrap.dedent("""
        import sys, types
        calls = []
        hub = types.ModuleType("huggingface_hub")
        hub.snapshot_download = lambda **kw: calls.append(kw)
        sys.modules["huggingface_hub"] = hub
        sys.argv = ["-c"] + sys.argv[1:]
        exec(compile(SCRIPT, "<fetch>", "exec"))
        print(sorted(calls, key=lambda c: c["repo_id"]))
    """).replace("SCRIPT", repr(fetch["command"][2]))
    out = subprocess.run([sys.executable, "-c", stub, *fetch["args"]], capture_output=True, text=True, check=True).stdout
    assert ("{'repo_id': 'Qwen/Qwen3-8B', 'revision': 'main', 'local_dir': '/app/models/target', "
            "'allow_patterns': None}") in out
    assert ("{'repo_id': 'dspark/qwen3-8b-dspark', 'revision': None, 'local_dir': '/app/models/dspark', "
            "'allow_patterns': ['config.json']}") in out


# ---------------------------------------------------------------------------- observability


def test_observability_objects_and_env(objects):
    objs = objects("observability")
    monitors = of_kind(objs, "ServiceMonitor")
    assert {component(m) for m in monitors} == {"scheduler", "verifier", "drafter"}
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)
    dashboard = named(objs, "ConfigMap", "dspark-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["dspark-overview.json"])
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for wanted in ("acceptance rate", "mean accepted length", "tokens/s", "time to first token", "verification budget"):
        assert wanted in titles, f"dashboard lacks a {wanted!r} panel"
    for panel in board["panels"]:
        for target in panel["targets"]:
            assert "dspark_" in target["expr"]
    for d in deployments(objs, dspark_only=True):
        e = env(main_container(d))
        assert e["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability:4317"
        assert e["OTEL_SERVICE_NAME"]["value"] == f"dspark-{component(d)}"
        attrs = e["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(",")
        assert "k8s.pod.name=$(POD_NAME)" in attrs and "deployment.environment=prod" in attrs


def test_no_otel_env_unless_enabled(objects):
    for d in deployments(objects("defaults"), dspark_only=True):
        assert not [n for n in env(main_container(d)) if n.startswith("OTEL_")]


def test_minimal_values_drop_optional_objects(objects):
    objs = objects("minimal")
    assert not of_kind(objs, "NetworkPolicy") and not of_kind(objs, "ServiceAccount")
    assert deployment_of(objs, "drafter") is None and not [o for o in objs if component(o) == "drafter"]
    assert "--drafter-path" not in main_container(deployment_of(objs, "verifier"))["args"]  # autoregressive
    assert {component(p) for p in of_kind(objs, "PodDisruptionBudget")} == {"verifier"}
    assert named(objs, "PodDisruptionBudget", "dspark-verifier")["spec"]["minAvailable"] == "50%"
    assert named(objs, "Service", "dspark-scheduler")["spec"]["type"] == "LoadBalancer"
    for d in deployments(objs):
        assert d["spec"]["template"]["spec"]["serviceAccountName"] == "default"
        assert "annotations" not in d["spec"]["template"]["metadata"]


def test_notes_print_a_ready_to_paste_health_check(chart):
    notes = render(chart, {})["dspark/templates/NOTES.txt"]
    assert "kubectl -n inference port-forward svc/dspark-scheduler 50051:50051 8000:8000" in notes
    assert "grpcurl -plaintext localhost:50051 grpc.health.v1.Health/Check" in notes
    assert "curl -fsS http://localhost:8000/health" in notes
    assert "kubectl -n inference exec deploy/dspark-scheduler -- python -c" in notes


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("values, message", [
    ({"redis": {"bundled": {"enabled": False}}}, "redis.external.url is required"),
    ({"models": {"source": "pvc"}}, "models.pvc.claimName is required"),
    ({"models": {"source": "hostPath"}}, "models.hostPath.path is required"),
    ({"models": {"source": "initContainer"}}, "models.initContainer.targetUri is required"),
    ({"autoscaling": {"keda": {"enabled": True}}}, "autoscaling.keda.prometheus.serverAddress is required"),
    ({"autoscaling": {"keda": {"enabled": True, "prometheus": {"serverAddress": "http://p:9090"}}, "hpa": {"enabled": True}}},
     "enable at most one of"),
    ({"autoscaling": {"hpa": {"enabled": True}}, "scheduler": {"autoscaler": {"enabled": True}}}, "enable at most one of"),
    ({"otel": {"enabled": True}}, "otel.endpoint is required"),
    ({"autoscaling": {"verifier": {"minReplicas": 5, "maxReplicas": 2}}}, "must not exceed maxReplicas"),
    ({"verifier": {"service": {"type": "NodePort"}}}, "verifier.service.headless needs"),
])
def test_inconsistent_values_fail_with_a_message_naming_the_value(chart, values, message):
    assert message in _render_error(chart, values)


def test_chart_defaults_start_on_a_model_without_sps_json(chart):
    """policy causal needs a cost table: by default the verifier profiles one at start-up when the model has
    none (tests/services/test_startup.py runs that start-up), so a user's own model does not crash-loop."""
    objs = manifests(render(chart, {}))
    sched = main_container(deployment_of(objs, "scheduler"))["args"]
    ver = main_container(deployment_of(objs, "verifier"))["args"]
    assert sched[sched.index("--policy") + 1] == "causal"
    assert float(ver[ver.index("--sps-profile-seconds") + 1]) > 0


def test_drafter_beside_the_verifier_runs_in_the_verifier_pod(chart):
    objs = manifests(render(chart, {"drafter": {"besideVerifier": True, "matmulDtype": "float32"},
                                    "verifier": {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "40Gi"}}}}))
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not any("drafter" in name for _, name in kinds), kinds  # no drafter pool at all
    ver = main_container(deployment_of(objs, "verifier"))
    args = ver["args"]
    assert args[args.index("--drafter-port") + 1] == "50053"
    assert args[args.index("--drafter-matmul-dtype") + 1] == "float32" and "--drafter-path" in args
    assert {"name": "drafter-grpc", "containerPort": 50053, "protocol": "TCP"} in ver["ports"]
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("verifier"))
    assert 50053 in {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}


def test_prometheus_rule_alerts_on_the_metrics_the_scheduler_exports(objects):
    """The optional PrometheusRule: collapse, calibration and acceptance-decay alerts whose PromQL names only
    metrics that services/common/metrics.py defines; the dashboard shows the same signals."""
    import re

    from prometheus_client import REGISTRY

    import services.common.metrics  # noqa: F401 - registers the metrics

    exported = set()
    for family in REGISTRY.collect():
        exported |= {s.name for s in family.samples} | {family.name}
    objs = objects("observability")
    (rule,) = of_kind(objs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"DSparkDrafterCollapsed", "DSparkCalibrationOutOfBound", "DSparkAcceptanceBelowExpectation"} <= set(rules)
    for r in rules.values():
        names = set(re.findall(r"\b(dspark_[a-z_]+)", r["expr"]))
        assert names and names <= exported | {n + "_total" for n in exported}, (r["alert"], names - exported)
        assert 'namespace="dspark"' in r["expr"] or "namespace=" in r["expr"]
    assert rules["DSparkDrafterCollapsed"]["for"] == "2m"
    assert not of_kind(objects("defaults"), "PrometheusRule")  # optional, like the ServiceMonitor
    board = json.loads(named(objs, "ConfigMap", "dspark-dashboard")["data"]["dspark-overview.json"])
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for metric in ("dspark_spec_decode_drafter_collapsed", "dspark_spec_decode_calibrated",
                   "dspark_spec_decode_calibration_ece", "dspark_spec_decode_expected_accepted_tokens_total",
                   "dspark_autoscale_required_replicas"):
        assert metric in exprs, f"dashboard does not show {metric}"


def test_scheduler_gets_the_online_operation_flags(objects):
    objs = objects("observability")
    args = next(d for d in of_kind(objs, "Deployment") if component(d) == "scheduler")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--calibration-bound") + 1] == "0.1"
    assert args[args.index("--collapse-ratio") + 1] == "0.25"
    assert "--target-user-tps" not in args  # 0 = off
    assert args[args.index("--slot-correction") + 1] == "off"
    assert args[args.index("--draft-gate-scope") + 1] == "batch"


def test_slot_correction_value_reaches_the_scheduler_flag(chart):
    on = main_container(deployment_of(manifests(render(chart, {"scheduler": {"slotCorrection": True}})), "scheduler"))
    assert on["args"][on["args"].index("--slot-correction") + 1] == "on"
    assert "slotCorrection" in _render_error(chart, {"scheduler": {"slotCorrection": "yes"}})


def test_draft_gate_scope_value_reaches_the_scheduler_flag(chart):
    req = main_container(deployment_of(manifests(render(chart, {"scheduler": {"draftGateScope": "request"}})),
                                       "scheduler"))
    assert req["args"][req["args"].index("--draft-gate-scope") + 1] == "request"
    assert "draftGateScope" in _render_error(chart, {"scheduler": {"draftGateScope": "step"}})


def test_max_requests_per_client_value_reaches_the_scheduler_flag(chart):
    args = main_container(deployment_of(manifests(render(chart, {})), "scheduler"))["args"]
    assert args[args.index("--max-requests-per-client") + 1] == "0"
    some = main_container(deployment_of(manifests(render(chart, {"scheduler": {"maxRequestsPerClient": 12}})),
                                        "scheduler"))
    assert some["args"][some["args"].index("--max-requests-per-client") + 1] == "12"
    assert "maxRequestsPerClient" in _render_error(chart, {"scheduler": {"maxRequestsPerClient": -1}})


def test_verifier_weights_value_reaches_the_service_flag(chart):
    """`verifier.weights` renders as the verifier's `--weights` (absent when empty: the service's auto)."""
    def args(values):
        return main_container(deployment_of(manifests(render(chart, values)), "verifier"))["args"]

    ver = args({"verifier": {"weights": "int8"}})
    assert ver[ver.index("--weights") + 1] == "int8"
    assert "--weights" not in args({})
    assert "weights" in _render_error(chart, {"verifier": {"weights": "int3"}})


def test_verifier_kv_cache_value_reaches_the_service_flag(chart):
    """`verifier.kvCacheGb` renders as `--kv-cache-gb` (absent at 0: the service's default budget)."""
    def args(values):
        return main_container(deployment_of(manifests(render(chart, values)), "verifier"))["args"]

    ver = args({"verifier": {"kvCacheGb": 12.5}})
    assert ver[ver.index("--kv-cache-gb") + 1] == "12.5"
    assert "--kv-cache-gb" not in args({})
    assert "kvCacheGb" in _render_error(chart, {"verifier": {"kvCacheGb": -1}})
