"""Lookups over rendered Kubernetes objects (plain dicts), shared by the chart tests."""

from __future__ import annotations

DSPARK_COMPONENTS = ("scheduler", "verifier", "drafter")


def component(obj: dict) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def deployments(objs: list[dict], *, dspark_only: bool = False) -> list[dict]:
    deps = of_kind(objs, "Deployment")
    return [d for d in deps if component(d) in DSPARK_COMPONENTS] if dspark_only else deps


def deployment_of(objs: list[dict], comp: str) -> dict | None:
    found = [d for d in of_kind(objs, "Deployment") if component(d) == comp]
    assert len(found) <= 1
    return found[0] if found else None


def pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def main_container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def container_ports(deployment: dict) -> dict[str, int]:
    """name -> containerPort over all containers of the pod."""
    ports = {}
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        for p in c.get("ports", []):
            ports[p["name"]] = p["containerPort"]
    return ports


def env(container: dict) -> dict[str, dict]:
    """name -> EnvVar of a container (duplicates are an error)."""
    out: dict[str, dict] = {}
    for e in container.get("env", []):
        assert e["name"] not in out, f"env {e['name']} set twice in container {container['name']}"
        out[e["name"]] = e
    return out
