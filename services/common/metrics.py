"""Prometheus metrics of every service (prefix `dspark_`, base-unit suffixes), defined once per process.

The four speculative-decoding counters mirror the ecosystem's (drafts, draft tokens, accepted tokens,
accepted tokens per position), so the usual PromQL for acceptance rate and mean accepted length works.
`start_metrics_server(port)` exposes them over HTTP. Knows nothing about models or gRPC.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, generate_latest, start_http_server

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# -- scheduler
SPEC_DRAFTS = Counter("dspark_spec_decode_drafts", "Draft blocks sent for verification (one per request and round)")
SPEC_DRAFT_TOKENS = Counter("dspark_spec_decode_draft_tokens", "Draft tokens sent for verification")
SPEC_ACCEPTED = Counter("dspark_spec_decode_accepted_tokens", "Draft tokens accepted by the target")
SPEC_ACCEPTED_POS = Counter("dspark_spec_decode_accepted_tokens_per_pos",
                            "Draft tokens accepted, by 0-based position in the block", ["position"])
# online operation (dspark_core.monitoring): calibration and collapse, per drafter; positions are 1-based
SPEC_EXPECTED = Counter("dspark_spec_decode_expected_accepted_tokens",
                        "Predicted survival a_k summed over verified draft positions (what the confidences expected)",
                        ["drafter", "position"])
SPEC_REALIZED = Counter("dspark_spec_decode_realized_accepted_tokens",
                        "Draft tokens accepted at the verified positions that SPEC_EXPECTED counts",
                        ["drafter", "position"])
SPEC_ECE = Gauge("dspark_spec_decode_calibration_ece",
                 "Running expected calibration error of the predicted survival, by position", ["drafter", "position"])
SPEC_ECE_FLOOR = Gauge("dspark_spec_decode_calibration_ece_floor",
                       "ECE a perfectly calibrated head would show on the same window (sampling noise)",
                       ["drafter", "position"])
SPEC_CALIBRATED = Gauge("dspark_spec_decode_calibrated",
                        "1 while calibration is within --calibration-bound, 0 while the policy runs the fixed length",
                        ["drafter"])
SPEC_FALLBACK_STEPS = Counter("dspark_spec_decode_calibration_fallback_steps",
                              "Steps a confidence policy verified the fixed length because calibration left its bound",
                              ["drafter"])
SPEC_COLLAPSED = Gauge("dspark_spec_decode_drafter_collapsed",
                       "1 while the drafter's acceptance has collapsed (its requests decode autoregressively)",
                       ["drafter"])
SPEC_COLLAPSES = Counter("dspark_spec_decode_drafter_collapses", "Times the collapse alarm fired", ["drafter"])
SPEC_ACCEPTANCE_RATIO = Gauge("dspark_spec_decode_acceptance_ratio",
                              "First-position acceptance over the recent window divided by its expectation",
                              ["drafter"])
SPEC_CONFIDENCE_OFFSET = Gauge("dspark_spec_decode_confidence_offset",
                               "Online slot correction: logit offset the engine adds to the drafter's calibrated "
                               "confidence, by kind of request (greedy / sampled) and position",
                               ["drafter", "kind", "position"])
SPEC_SKIPPED = Counter("dspark_spec_decode_skipped_rounds",
                       "Request-rounds decoded without drafting because the drafter collapsed", ["drafter"])
SPEC_LOOKUP_ROUNDS = Counter("dspark_spec_decode_lookup_rounds",
                             "Request-rounds that verified an n-gram lookup draft instead of the drafter's block",
                             ["drafter"])
SPEC_LOOKUP_ACCEPTED = Counter("dspark_spec_decode_lookup_accepted_tokens",
                               "Draft tokens accepted in rounds that verified an n-gram lookup draft", ["drafter"])
REQUIRED_REPLICAS = Gauge("dspark_autoscale_required_replicas",
                          "Replicas needed to hold --target-user-tps per user at the current load, per pool", ["pool"])
PREDICTED_USER_TPS = Gauge("dspark_autoscale_predicted_user_tokens_per_second",
                           "Per-user speed the capacity model predicts at the current replicas and load")
REQUESTS_RUNNING = Gauge("dspark_requests_running", "Requests in the engine's active batch")
REQUESTS_WAITING = Gauge("dspark_requests_waiting", "Requests queued for admission")
REQUESTS = Counter("dspark_requests", "Finished requests, by finish reason", ["finish_reason"])
GENERATED_TOKENS = Counter("dspark_generation_tokens", "Tokens generated")
TTFT = Histogram("dspark_time_to_first_token_seconds", "Time from accepting a request to its first token",
                 buckets=_LATENCY)
ITL = Histogram("dspark_inter_token_latency_seconds", "Time between tokens of a request (per token)",
                buckets=_LATENCY)
E2E = Histogram("dspark_request_duration_seconds", "Time from accepting a request to its last token",
                buckets=_LATENCY)
VERIFY_BUDGET = Gauge("dspark_verification_budget_tokens",
                      "Draft tokens the policy admitted for verification in the last round, per verifier",
                      ["verifier"])
DEMAND = Gauge("dspark_verification_demand_tokens",
               "Expected accepted draft tokens (survival-probability mass) this scheduler wants verified, per verifier",
               ["verifier"])


def forget_verifier(verifier_id: str) -> None:
    """A verifier that left the pool takes its per-verifier series with it (else each keeps its last value
    forever: a dashboard shows demand on a pod that is gone, and every pod ever seen stays a series)."""
    for gauge in (VERIFY_BUDGET, DEMAND):
        try:
            gauge.remove(verifier_id)
        except KeyError:
            pass


DESIRED_REPLICAS = Gauge("dspark_desired_replicas", "Desired replicas per pool, from load", ["pool"])
FAILOVERS = Counter("dspark_failovers", "Requests moved to another replica after a failure", ["pool"])
DRAFTLESS_ROUNDS = Counter("dspark_draftless_rounds",
                           "Request rounds verified without drafts because no drafter could draft for them")
STAGE_SECONDS = Counter("dspark_scheduler_stage_seconds",
                        "Engine-thread wall time by stage of the step (services/scheduler/stages.py)", ["stage"])
STEPS = Counter("dspark_scheduler_steps", "Engine steps the scheduler ran")
REDIS_UP = Gauge("dspark_redis_up", "1 when the last Redis operation succeeded")

# -- verifier and drafter
FORWARD_SECONDS = Histogram("dspark_forward_seconds", "Batched forward pass time", ["service", "rpc"],
                            buckets=_LATENCY)
BATCH_TOKENS = Histogram("dspark_batch_tokens", "Tokens in a batched forward pass", ["service", "rpc"],
                         buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
BATCH_CALLS = Histogram("dspark_coalesced_calls", "RPCs merged into one forward pass", ["service"],
                        buckets=(1, 2, 3, 4, 6, 8, 16))
ACTIVE_STATES = Gauge("dspark_active_requests", "Requests whose state (KV cache / draft context) is held",
                      ["service"])
VERIFIER_EXPIRED = Counter("dspark_verifier_expired_requests",
                           "Requests a verifier released after --idle-ttl seconds without prefill, verify or "
                           "resume (their scheduler vanished without a Release)")


def start_metrics_server(port: int) -> None:
    from dspark_core.errors import InvalidArgument

    try:
        start_http_server(port)
    except OSError as exc:
        raise InvalidArgument("--metrics-port", port, f"must be a port free to bind ({exc.strerror or exc})") from None


def render() -> bytes:
    return generate_latest()
