"""The scheduler's built-in pool scaler (`--autoscale`): patch the drafter / verifier Deployments' scale
to the desired replica count, within bounds and HPA-style stabilisation windows.

Settings come from DSPARK_AUTOSCALE_POOLS (JSON, written by the Helm chart: pool -> {deployment,
minReplicas, maxReplicas, scaleUpStabilizationWindowSeconds, scaleDownStabilizationWindowSeconds}) and
the namespace from POD_NAMESPACE; the entry point reads both. Like the HPA: scaling up follows the lowest
recommendation of the up-window, scaling down the highest of the down-window, so a brief spike or dip does
not move pods. Knows nothing about how the desired count is computed (the engine loop publishes it).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass

from dspark_core.errors import InvalidArgument

log = logging.getLogger("dspark.autoscaler")


@dataclass(frozen=True)
class PoolScaling:
    deployment: str
    min_replicas: int = 1
    max_replicas: int = 10
    up_window_s: float = 0.0
    down_window_s: float = 300.0

    def __post_init__(self):
        if not self.deployment:
            raise InvalidArgument("deployment", self.deployment, "must name a Deployment")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise InvalidArgument("minReplicas", self.min_replicas, f"must be in [0, maxReplicas={self.max_replicas}]")


def parse_pools(text: str) -> dict[str, PoolScaling]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument("DSPARK_AUTOSCALE_POOLS", text[:80], f"must be JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise InvalidArgument("DSPARK_AUTOSCALE_POOLS", text[:80], "must be a JSON object pool -> settings")
    out = {}
    for pool, d in raw.items():
        if pool not in ("drafter", "verifier") or not isinstance(d, dict):
            raise InvalidArgument("DSPARK_AUTOSCALE_POOLS", pool, "must map drafter / verifier to settings objects")
        out[pool] = PoolScaling(str(d.get("deployment", "")), int(d.get("minReplicas", 1)), int(d.get("maxReplicas", 10)),
                                float(d.get("scaleUpStabilizationWindowSeconds", 0)),
                                float(d.get("scaleDownStabilizationWindowSeconds", 300)))
    return out


class Autoscaler:
    """Feed `observe(pool, desired)`; `step()` patches each Deployment whose stabilised target changed."""

    def __init__(self, pools: dict[str, PoolScaling], namespace: str, api=None, clock=time.monotonic):
        self.pools, self.namespace, self.clock = pools, namespace, clock
        self._api = api
        self._history: dict[str, deque] = {p: deque() for p in pools}
        self._last: dict[str, int] = {}

    def api(self):
        if self._api is None:
            from kubernetes import client, config

            config.load_incluster_config()
            self._api = client.AppsV1Api()
        return self._api

    def observe(self, pool: str, desired: int) -> None:
        if pool in self.pools:
            self._history[pool].append((self.clock(), int(desired)))

    def target(self, pool: str, current: int) -> int:
        s, h, now = self.pools[pool], self._history[pool], self.clock()
        keep = max(s.up_window_s, s.down_window_s)
        while h and now - h[0][0] > keep:
            h.popleft()
        if not h:
            return current
        latest = h[-1][1]
        if latest > current:  # up: the lowest recommendation within the up-window
            want = min(d for t, d in h if now - t <= s.up_window_s) if s.up_window_s > 0 else latest
            want = max(want, current)
        elif latest < current:  # down: the highest recommendation within the down-window
            want = max(d for t, d in h if now - t <= s.down_window_s) if s.down_window_s > 0 else latest
            want = min(want, current)
        else:
            want = current
        return max(s.min_replicas, min(s.max_replicas, want))

    def step(self) -> dict[str, int]:
        changed = {}
        for pool, s in self.pools.items():
            try:
                scale = self.api().read_namespaced_deployment_scale(s.deployment, self.namespace)
                current = int(scale.spec.replicas or 0)
                want = self.target(pool, current)
                if want != current:
                    self.api().patch_namespaced_deployment_scale(s.deployment, self.namespace,
                                                                 {"spec": {"replicas": want}})
                    log.info("scaled pool", extra={"pool": pool, "deployment": s.deployment, "from": current, "to": want})
                    changed[pool] = want
            except Exception as exc:  # noqa: BLE001 - scaling is advisory; keep serving
                log.warning("autoscale of %s failed: %s", pool, exc)
        return changed
