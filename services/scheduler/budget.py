"""Cluster-wide verification budgets for the async policy (paper section 5.2), sized per verifier.

Every scheduler publishes, per verifier, the confidence rows of its requests there (its demand). For each
verifier one scheduler owns the budget (the lowest id among those with demand): it merges every
scheduler's rows and sizes the capacity K = async_capacity(rows, SPS of that verifier), the global best
over a pool that is at least one publication old (so it cannot depend on the drafts being verified now:
losslessness holds). Each scheduler then admits its share of K, in proportion to its survival mass,
top-K over its current candidates on that verifier. Knows nothing about gRPC; Redis through Registry.
"""

from __future__ import annotations

import logging

from dspark_core import scheduling
from dspark_core.cost_model import SpsTable

from ..common import metrics
from ..common.registry import Registry

log = logging.getLogger("dspark.budget")


class ClusterBudgets:
    def __init__(self, registry: Registry, scheduler_id: str):
        self.registry, self.scheduler_id = registry, scheduler_id
        self.shares: dict[str, int] = {}  # verifier id -> draft tokens this scheduler may admit per step

    def update(self, demand: dict[str, tuple], sps_tables: dict[str, list]) -> None:
        """demand: verifier id -> (mass, requests, confidence rows) of this scheduler (already published)."""
        shares = {}
        for vid, (mass, _, _) in demand.items():
            points = sps_tables.get(vid) or []
            if not points:
                continue
            records = self.registry.demand_by_scheduler(vid)
            if not records:
                continue
            if min(records) == self.scheduler_id:  # the owner sizes and publishes the budget
                rows = [row for rec in records.values() for row in rec.get("confidences", [])]
                sps = SpsTable(tuple(int(b) for b, _ in points), tuple(float(x) for _, x in points))
                self.registry.publish_budget(vid, scheduling.async_capacity(rows, sps))
            budget = self.registry.read_budget(vid)
            if budget is None:
                continue
            metrics.VERIFY_BUDGET.labels(verifier=vid).set(budget)
            total = sum(float(rec.get("mass", 0.0)) for rec in records.values()) or 1.0
            shares[vid] = max(0, round(budget * mass / total))
        self.shares = shares


class BudgetedPolicy:
    """Wraps the async policy (an engine policy, see dspark_core.scheduling): requests on a verifier with a
    cluster budget get top-K of it. `verifier_of(request_id)` names a request's verifier (None: none yet)."""

    def __init__(self, inner, verifier_of, budgets: ClusterBudgets):
        self.inner, self.verifier_of, self.budgets = inner, verifier_of, budgets
        self.applied = 0  # rounds in which a cluster budget decided some lengths

    def __call__(self, confs, sps, request_ids):
        lengths = list(self.inner(confs, sps, request_ids))  # keeps the inner policy's own lag state current
        shares = dict(self.budgets.shares)
        if not shares:
            return lengths
        groups: dict[str, list[int]] = {}
        for i, rid in enumerate(request_ids):
            vid = self.verifier_of(rid)
            if vid in shares:
                groups.setdefault(vid, []).append(i)
        if groups:
            self.applied += 1
        for vid, idx in groups.items():
            sub = scheduling.async_topk_schedule([confs[i] for i in idx], shares[vid])
            for i, l in zip(idx, sub):
                lengths[i] = l
        return lengths
