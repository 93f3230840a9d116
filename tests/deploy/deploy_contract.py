"""What the deployment files may assume about the services and the CRDs they target.

- SERVE: the `dspark serve <component>` flags of the services' contract, so that the chart's and
  compose's command lines are checked even before the CLI exists (test_cli_args.py then checks
  them with the real parser).
- CRD_SCHEMAS: the subset of KEDA, Prometheus-operator and cert-manager CRD schemas the chart uses, strict about
  unknown fields (kubernetes-validate has no schemas for CRDs).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServeFlags:
    required: frozenset[str]
    optional: frozenset[str] = field(default_factory=frozenset)
    switches: frozenset[str] = field(default_factory=frozenset)


SERVE: dict[str, ServeFlags] = {
    "scheduler": ServeFlags(
        required=frozenset({"--port", "--http-port", "--metrics-port", "--redis-url"}),
        # --target: the tokenizer's directory (the service has it; the brief's contract does not list it)
        # --calibration-bound / --collapse-ratio / --target-user-tps: online operation (issue 17)
        # --draft-window: the drafter's context window (EngineConfig.draft_window)
        # --slot-correction: the online slot correction (EngineConfig.slot_correction)
        # --draft-gate-scope: what the draft gate decides for (EngineConfig.draft_gate_scope)
        # --max-requests-per-client: one client's share of the scheduler (Frontend.hold)
        # --lookup-ngram: n-gram lookup drafts for greedy requests (EngineConfig.lookup_ngram)
        optional=frozenset({"--policy", "--target", "--served-model-name", "--calibration-bound", "--collapse-ratio",
                            "--target-user-tps", "--draft-window", "--slot-correction",
                            "--draft-gate-scope", "--lookup-ngram", "--max-requests-per-client"}),
        switches=frozenset({"--autoscale"}),
    ),
    "verifier": ServeFlags(
        required=frozenset({"--port", "--metrics-port", "--redis-url", "--target"}),
        # --drafter-path: whose config.json names the layers to tap (the service has it; the brief does not list it)
        optional=frozenset({"--device", "--dtype", "--weights", "--kv-cache-gb", "--drafter-path", "--idle-ttl",
                            "--sps-profile-seconds", "--drafter-port", "--drafter-matmul-dtype"}),
    ),
    "drafter": ServeFlags(
        # --target: a drafter that references its target's embedding and LM head reads them from there
        required=frozenset({"--port", "--metrics-port", "--redis-url", "--drafter-path", "--target"}),
        optional=frozenset({"--device", "--dtype", "--drafter-matmul-dtype"}),
    ),
}


def parse_serve_args(argv: list[str]) -> tuple[str, dict[str, str | bool]]:
    """`serve <component> --flag value ...` -> (component, {flag: value}); AssertionError if off-contract."""
    assert argv[:1] == ["serve"] and len(argv) >= 2, f"expected `serve <component> ...`, got {argv}"
    component = argv[1]
    assert component in SERVE, f"unknown component {component!r} in {argv}"
    spec = SERVE[component]
    flags: dict[str, str | bool] = {}
    rest = argv[2:]
    i = 0
    while i < len(rest):
        flag = rest[i]
        assert flag not in flags, f"{flag} given twice in {argv}"
        if flag in spec.switches:
            flags[flag] = True
            i += 1
            continue
        assert flag in spec.required | spec.optional, f"{flag} is not a `dspark serve {component}` flag: {argv}"
        assert i + 1 < len(rest) and not rest[i + 1].startswith("--"), f"{flag} has no value in {argv}"
        assert isinstance(rest[i + 1], str), f"{flag} value must be a string in {argv}"
        flags[flag] = rest[i + 1]
        i += 2
    missing = spec.required - flags.keys()
    assert not missing, f"`dspark serve {component}` lacks {sorted(missing)}: {argv}"
    for port_flag in ("--port", "--http-port", "--metrics-port"):
        if port_flag in flags:
            assert str(flags[port_flag]).isdigit(), f"{port_flag} must be a port number in {argv}"
    return component, flags


def _strict(properties: dict, required: list[str] | None = None) -> dict:
    schema: dict = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        schema["required"] = required
    return schema


_METADATA = _strict(
    {"name": {"type": "string", "maxLength": 253}, "namespace": {"type": "string"},
     "labels": {"type": "object", "additionalProperties": {"type": "string"}},
     "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
    ["name"],
)
_NAME_REF = _strict({"name": {"type": "string", "minLength": 1}}, ["name"])
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_BEHAVIOR = {"type": "object"}  # autoscaling/v2 HPA behavior; validated through the HPA schema in the tests

_TRIGGER = _strict(
    {
        "type": {"enum": ["prometheus", "redis"]},
        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
        "metadata": _STRING_MAP,
        "authenticationRef": _strict({"name": {"type": "string"}, "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]}}, ["name"]),
        "name": {"type": "string"},
    },
    ["type", "metadata"],
)

CRD_SCHEMAS: dict[tuple[str, str], dict] = {
    # https://keda.sh/docs/latest/reference/scaledobject-spec/
    ("keda.sh/v1alpha1", "ScaledObject"): _strict(
        {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": _METADATA,
            "spec": _strict(
                {
                    "scaleTargetRef": _strict(
                        {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"},
                         "envSourceContainerName": {"type": "string"}},
                        ["name"],
                    ),
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                    "idleReplicaCount": {"type": "integer", "minimum": 0},
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "fallback": {"type": "object"},
                    "advanced": _strict(
                        {
                            "restoreToOriginalReplicaCount": {"type": "boolean"},
                            "horizontalPodAutoscalerConfig": _strict({"name": {"type": "string"}, "behavior": _BEHAVIOR}),
                            "scalingModifiers": {"type": "object"},
                        }
                    ),
                    "triggers": {"type": "array", "minItems": 1, "items": _TRIGGER},
                },
                ["scaleTargetRef", "triggers"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    # https://keda.sh/docs/latest/concepts/authentication/
    ("keda.sh/v1alpha1", "TriggerAuthentication"): _strict(
        {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "TriggerAuthentication"},
            "metadata": _METADATA,
            "spec": _strict(
                {
                    "secretTargetRef": {
                        "type": "array",
                        "minItems": 1,
                        "items": _strict({"parameter": {"type": "string"}, "name": {"type": "string"}, "key": {"type": "string"}},
                                         ["parameter", "name", "key"]),
                    }
                },
                ["secretTargetRef"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    # https://cert-manager.io/docs/reference/api-docs/#cert-manager.io/v1.Certificate
    ("cert-manager.io/v1", "Certificate"): _strict(
        {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": "Certificate"},
            "metadata": _METADATA,
            "spec": _strict(
                {
                    "secretName": {"type": "string", "minLength": 1},
                    "commonName": {"type": "string", "maxLength": 64},
                    "dnsNames": {"type": "array", "items": {"type": "string"}},
                    "ipAddresses": {"type": "array", "items": {"type": "string"}},
                    "duration": {"type": "string", "pattern": "^[0-9]+(h|m|s)$"},
                    "renewBefore": {"type": "string", "pattern": "^[0-9]+(h|m|s)$"},
                    "privateKey": _strict({"algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"},
                                           "rotationPolicy": {"enum": ["Never", "Always"]},
                                           "encoding": {"enum": ["PKCS1", "PKCS8"]}}),
                    "usages": {"type": "array", "items": {"enum": [
                        "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
                        "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
                        "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
                        "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]}},
                    "issuerRef": _strict({"name": {"type": "string", "minLength": 1},
                                          "kind": {"enum": ["Issuer", "ClusterIssuer"]}, "group": {"type": "string"}},
                                         ["name"]),
                },
                ["secretName", "issuerRef"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    # https://prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.ServiceMonitor
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _strict(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": _METADATA,
            "spec": _strict(
                {
                    "selector": _strict({"matchLabels": _STRING_MAP, "matchExpressions": {"type": "array"}}),
                    "namespaceSelector": _strict({"matchNames": {"type": "array", "items": {"type": "string"}}, "any": {"type": "boolean"}}),
                    "jobLabel": {"type": "string"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": _strict(
                            {"port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                             "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                             "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}},
                            ["port"],
                        ),
                    },
                },
                ["selector", "endpoints"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    # https://prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.PrometheusRule
    ("monitoring.coreos.com/v1", "PrometheusRule"): _strict(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": _METADATA,
            "spec": _strict(
                {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": _strict(
                            {
                                "name": {"type": "string", "minLength": 1},
                                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                "rules": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": _strict(
                                        {"alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                         "record": {"type": "string"},
                                         "expr": {"type": "string", "minLength": 1},
                                         "for": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                         "labels": _STRING_MAP, "annotations": _STRING_MAP},
                                        ["expr"],
                                    ),
                                },
                            },
                            ["name", "rules"],
                        ),
                    }
                },
                ["groups"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
}
