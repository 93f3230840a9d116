"""The chart's trust wiring: mutual TLS Secrets (cert-manager or existing) mounted in every pod with
DSPARK_TLS_DIR, probes that speak TLS, client API keys from a Secret on the scheduler only, and
NetworkPolicies that admit the release's own pods unless told whom else."""

from __future__ import annotations

import pytest

from chart_objects import deployment_of, env, main_container, named, of_kind

helm = pytest.importorskip("helm_python")

COMPONENTS = ("scheduler", "verifier", "drafter")
GRPC_PORTS = {"scheduler": 50051, "verifier": 50052, "drafter": 50053}


def _tls_volume(dep: dict) -> dict | None:
    vols = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    return vols[0] if vols else None


def test_cert_manager_issues_one_certificate_per_component_and_every_pod_mounts_its_own(objects):
    objs = objects("tls-cert-manager")
    certs = {c["metadata"]["name"]: c["spec"] for c in of_kind(objs, "Certificate")}
    assert sorted(certs) == [f"dspark-{c}" for c in sorted(COMPONENTS)]
    for comp in COMPONENTS:
        spec = certs[f"dspark-{comp}"]
        assert spec["commonName"] == f"dspark-{comp}" and "dspark" in spec["dnsNames"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["issuerRef"] == {"name": "dspark-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        dep = deployment_of(objs, comp)
        assert _tls_volume(dep)["secret"]["secretName"] == spec["secretName"] == f"dspark-{comp}-tls"
        c = main_container(dep)
        assert env(c)["DSPARK_TLS_DIR"]["value"] == "/etc/dspark/tls"
        assert {"name": "tls", "mountPath": "/etc/dspark/tls", "readOnly": True} in c["volumeMounts"]
        # kubelet's grpc probes are plaintext: with TLS the same health check runs as an exec probe
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert "grpc" not in probe
            assert probe["exec"]["command"] == ["python3", "-m", "services.common.probe", "--port",
                                                str(GRPC_PORTS[comp])]


def test_existing_tls_secrets_are_used_as_named(objects):
    objs = objects("tls-secrets")
    assert not of_kind(objs, "Certificate")
    names = {comp: _tls_volume(deployment_of(objs, comp))["secret"]["secretName"] for comp in COMPONENTS}
    assert names == {"scheduler": "dspark-scheduler-tls", "verifier": "my-verifier-tls", "drafter": "dspark-drafter-tls"}


def test_api_keys_reach_the_scheduler_only(objects):
    objs = objects("tls-cert-manager")
    key = env(main_container(deployment_of(objs, "scheduler")))["DSPARK_API_KEYS"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "dspark-api-keys", "key": "api-keys"}
    for comp in ("verifier", "drafter"):
        assert "DSPARK_API_KEYS" not in env(main_container(deployment_of(objs, comp)))


def test_without_tls_nothing_is_mounted_and_probes_are_grpc(objects):
    objs = objects("defaults")
    assert not of_kind(objs, "Certificate")
    for comp in COMPONENTS:
        c = main_container(deployment_of(objs, comp))
        assert _tls_volume(deployment_of(objs, comp)) is None and "DSPARK_TLS_DIR" not in env(c)
        assert "DSPARK_API_KEYS" not in env(c)
        assert c["readinessProbe"]["grpc"]["port"] == GRPC_PORTS[comp]


def test_network_policies_admit_only_the_release_unless_told(objects):
    release = [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "dspark"}}}]
    rules = named(objects("defaults"), "NetworkPolicy", "dspark-scheduler")["spec"]["ingress"]
    assert [r["from"] for r in rules] == [release, release, release]  # grpc, http, metrics
    rules = named(objects("tls-cert-manager"), "NetworkPolicy", "dspark-scheduler")["spec"]["ingress"]
    ns = [[p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in r["from"]] for r in rules]
    assert ns == [["ingress-nginx"], ["ingress-nginx"], ["monitoring"]]


def test_cert_manager_without_an_issuer_fails_naming_the_value(chart):
    with pytest.raises(helm.HelmError) as e:
        chart.render({"tls": {"enabled": True, "certManager": {"enabled": True}}}, name="dspark", namespace="inference")
    assert "tls.certManager.issuerName" in str(e.value)
