"""The built-in scaler over real HTTP: the `kubernetes` client against a loopback server that implements
the two Deployment scale endpoints it calls (GET and PATCH .../deployments/NAME/scale)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.scheduler.autoscaler import Autoscaler, parse_pools


class FakeScaleApi(BaseHTTPRequestHandler):
    """apps/v1 Scale subresource for Deployments held in `self.server.replicas` (name -> count)."""

    def _target(self):
        parts = self.path.split("?")[0].strip("/").split("/")
        # apis/apps/v1/namespaces/NS/deployments/NAME/scale
        if parts[:4] != ["apis", "apps", "v1", "namespaces"] or parts[5] != "deployments" or parts[7:] != ["scale"]:
            return None, None
        return parts[4], parts[6]

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self, ns, name):
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"replicas": self.server.replicas[name]}, "status": {"replicas": self.server.replicas[name]}}

    def do_GET(self):  # noqa: N802 - http.server API
        ns, name = self._target()
        if name not in self.server.replicas:
            return self._send(404, {"kind": "Status", "code": 404, "message": f"deployments {name!r} not found"})
        self.server.calls.append(("GET", ns, name, self.headers.get("Content-Type")))
        self._send(200, self._scale(ns, name))

    def do_PATCH(self):  # noqa: N802
        ns, name = self._target()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.calls.append(("PATCH", ns, name, self.headers.get("Content-Type")))
        self.server.replicas[name] = body["spec"]["replicas"]
        self._send(200, self._scale(ns, name))

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture()
def scale_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeScaleApi)
    server.replicas = {"dspark-verifier": 1, "dspark-drafter": 2}
    server.calls = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.server_address[1]}"
    yield server, client.AppsV1Api(client.ApiClient(cfg))
    server.shutdown()


def test_builtin_scaler_patches_the_scale_subresource_over_http(scale_api):
    server, api = scale_api
    pools = parse_pools(json.dumps({
        "verifier": {"deployment": "dspark-verifier", "minReplicas": 1, "maxReplicas": 3,
                     "scaleUpStabilizationWindowSeconds": 0, "scaleDownStabilizationWindowSeconds": 30},
        "drafter": {"deployment": "dspark-drafter", "minReplicas": 1, "maxReplicas": 8,
                    "scaleUpStabilizationWindowSeconds": 0, "scaleDownStabilizationWindowSeconds": 0}}))
    now = [0.0]
    scaler = Autoscaler(pools, "serving", api=api, clock=lambda: now[0])
    scaler.observe("verifier", 5)  # clamped to maxReplicas
    scaler.observe("drafter", 2)  # already there: no patch
    assert scaler.step() == {"verifier": 3}
    assert server.replicas == {"dspark-verifier": 3, "dspark-drafter": 2}
    patches = [c for c in server.calls if c[0] == "PATCH"]
    assert [(c[1], c[2]) for c in patches] == [("serving", "dspark-verifier")]
    assert "json" in patches[0][3]  # a JSON (merge or strategic) patch body
    now[0] = 10
    scaler.observe("verifier", 1)  # scale-down waits out its stabilisation window
    assert scaler.step() == {} and server.replicas["dspark-verifier"] == 3
    now[0] = 45
    scaler.observe("verifier", 1)
    assert scaler.step() == {"verifier": 1} and server.replicas["dspark-verifier"] == 1


def test_builtin_scaler_keeps_serving_when_the_api_fails(scale_api):
    server, api = scale_api
    pools = parse_pools(json.dumps({"verifier": {"deployment": "missing-deployment", "maxReplicas": 3}}))
    scaler = Autoscaler(pools, "serving", api=api)
    scaler.observe("verifier", 2)
    assert scaler.step() == {}  # a 404 is logged, not raised
