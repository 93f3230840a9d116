"""The chart under test, its values matrix, and offline rendering with the real Helm engine.

helm-python-sdk binds libhelm_c (Helm's Go SDK) in process: rendering needs no cluster, no network
and no helm binary.
"""

from __future__ import annotations

from pathlib import Path

import yaml

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "dspark"
RELEASE = "dspark"
NAMESPACE = "inference"

# name -> values overriding the chart defaults. Each entry switches on one deployment shape.
MATRIX: dict[str, dict] = {
    "defaults": {},
    "keda-prometheus": {
        "autoscaling": {"keda": {"enabled": True, "prometheus": {"serverAddress": "http://prometheus-operated.monitoring:9090"}}},
    },
    "keda-redis-auth": {
        "autoscaling": {"keda": {"enabled": True, "trigger": "redis"}},
        "redis": {"auth": {"existingSecret": "dspark-redis"}},
        "networkPolicy": {"redisExtraFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}}]},
    },
    "hpa-external": {"autoscaling": {"hpa": {"enabled": True}}},
    "hpa-object": {"autoscaling": {"hpa": {"enabled": True, "metricType": "Object"}}},
    "external-redis": {
        "redis": {
            "bundled": {"enabled": False},
            "external": {"url": "rediss://redis.shared.svc:6380/2"},
            "auth": {"existingSecret": "shared-redis", "existingSecretPasswordKey": "password"},
        },
        "autoscaling": {"keda": {"enabled": True, "trigger": "redis"}},
    },
    "builtin-scaler": {"scheduler": {"autoscaler": {"enabled": True}}},
    "gpu": {
        "shm": {"enabled": True},
        "verifier": {
            "device": "cuda",
            "dtype": "bfloat16",
            "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi", "nvidia.com/gpu": 1}},
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "runtimeClassName": "nvidia",
        },
        "drafter": {
            "device": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": 1}},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
    "gpu-drafter-beside-verifier": {
        "drafter": {"besideVerifier": True},
        "verifier": {
            "device": "cuda",
            "dtype": "bfloat16",
            "resources": {"requests": {"cpu": "4", "memory": "28Gi"},
                          "limits": {"memory": "48Gi", "nvidia.com/gpu": 1}},
        },
    },
    "observability": {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        "grafana": {"dashboard": {"enabled": True}},
        "otel": {"enabled": True, "endpoint": "http://otel-collector.observability:4317", "resourceAttributes": {"deployment.environment": "prod"}},
    },
    "models-pvc": {"models": {"source": "pvc", "pvc": {"claimName": "llm-weights", "subPath": "qwen3"}}},
    "models-hostpath": {"models": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}}},
    "models-init": {
        "models": {
            "source": "initContainer",
            "target": "target",
            "drafter": "dspark",
            "initContainer": {
                "targetUri": "hf://Qwen/Qwen3-8B@main",
                "drafterUri": "hf://dspark/qwen3-8b-dspark",
                "tokenSecret": {"name": "hf-token", "key": "token"},
            },
        },
    },
    "tls-cert-manager": {
        "tls": {"enabled": True, "certManager": {"enabled": True, "issuerName": "dspark-ca", "issuerKind": "ClusterIssuer"}},
        "apiKeys": {"existingSecret": "dspark-api-keys"},
        "networkPolicy": {"clientsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}],
                          "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
    },
    "tls-secrets": {"tls": {"enabled": True, "existingSecrets": {"verifier": "my-verifier-tls"}}},
    "minimal": {
        "serviceAccount": {"create": False},
        "networkPolicy": {"enabled": False},
        "metrics": {"scrapeAnnotations": False},
        "scheduler": {"podDisruptionBudget": {"enabled": False}, "service": {"type": "LoadBalancer"}},
        "verifier": {"podDisruptionBudget": {"minAvailable": "50%"}, "probes": {"liveness": {"enabled": False}}},
        "drafter": {"enabled": False},
    },
}


def render(chart, values: dict | None = None) -> dict[str, str]:
    """template path -> rendered text, for these values."""
    return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)


def manifests(rendered: dict[str, str]) -> list[dict]:
    """Every Kubernetes object of a render (NOTES.txt excluded)."""
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.load_all(text, Loader=_LOADER):
            if doc:
                docs.append(doc)
    return docs
