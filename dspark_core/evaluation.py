"""Offline evaluation of a drafter against its target, the paper's protocol (algorithms.md section 10).

Protocol: fixed block (the "fixed" policy, no scheduler), sampling temperature 1.0 by default, the first
turn of each prompt, prompts batched through the engine (continuous batching). Every drafting round is
logged: drafts verified (`proposed`), drafts accepted, tokens committed and, for drafters with a
confidence head, the raw confidence logits of the proposed positions (the rollout records that
calibration and the threshold sweep need).

Metrics, per position k = 1..gamma:
- tau: mean tokens committed per round, the target's own (bonus / recovered) token included;
- conditional acceptance at k: among rounds that proposed >= k drafts and accepted the first k-1, the
  fraction that accepted the k-th;
- survival at k: among rounds that proposed >= k drafts, the fraction that accepted the first k
  (unconditional: no requirement on earlier positions beyond what acceptance itself implies).

Also the cost of DSpark's sequential head (`measure_head_cost`). Knows nothing about files, argument
parsing or plotting; prompts come in as token ids.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from .errors import InvalidArgument

# ---- the round log ---------------------------------------------------------------------------------


@dataclass
class RoundLog:
    """Every drafting round of an evaluation run, flattened over requests (in prompt order)."""

    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    # raw confidence logits of the proposed positions per round; None for drafters without a head
    confidence_logits: list[list[float]] | None = None
    prompt_index: list[int] = field(default_factory=list)
    tokens: int = 0  # generated tokens kept, over all requests
    skipped_prompts: int = 0  # longer than the context window allows

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    def extend(self, other: RoundLog) -> None:
        """Append another run's rounds (e.g. the same prompts with other seeds; prompt indices are kept, so
        splits by prompt stay disjoint)."""
        if (self.confidence_logits is None) != (other.confidence_logits is None):
            raise InvalidArgument("other", "confidence logits", "both logs must come from the same kind of drafter")
        self.accepted += other.accepted
        self.proposed += other.proposed
        self.committed += other.committed
        self.prompt_index += other.prompt_index
        if self.confidence_logits is not None:
            self.confidence_logits += other.confidence_logits
        self.tokens += other.tokens
        self.skipped_prompts = max(self.skipped_prompts, other.skipped_prompts)


def tau(log: RoundLog) -> float:
    """Mean committed tokens per round (accepted drafts + the target's own token)."""
    return sum(log.committed) / len(log.committed) if log.committed else math.nan


def conditional_acceptance(accepted: list[int], proposed: list[int], gamma: int) -> list[float | None]:
    out = []
    for k in range(1, gamma + 1):
        den = sum(1 for a, p in zip(accepted, proposed) if p >= k and a >= k - 1)
        num = sum(1 for a, p in zip(accepted, proposed) if p >= k and a >= k)
        out.append(num / den if den else None)
    return out


def survival(accepted: list[int], proposed: list[int], gamma: int) -> list[float | None]:
    out = []
    for k in range(1, gamma + 1):
        den = sum(1 for p in proposed if p >= k)
        num = sum(1 for a, p in zip(accepted, proposed) if p >= k and a >= k)
        out.append(num / den if den else None)
    return out


def threshold_sweep(log: RoundLog, temperatures=None, thresholds=None, biases=None) -> list[dict]:
    """Offline static-threshold policy from fixed-policy rollouts (paper Fig. 5).

    For threshold h a round verifies l = the drafts before the first position whose own calibrated
    confidence c_k = sigmoid(logit_k / t_k + b_k) < h (as `scheduling.threshold_schedule`); it would then
    accept min(accepted, l) drafts,
    because verification decides position i from positions <= i only. Returns per threshold: tau and the
    tokens verified per round (l + 1, the anchor included).
    """
    if log.confidence_logits is None:
        raise InvalidArgument("drafter", "no confidence head", "a threshold sweep needs confidence logits")
    thresholds = [round(0.05 * i, 2) for i in range(20)] if thresholds is None else list(thresholds)
    rows = []
    for h in thresholds:
        taus, verified = [], []
        for a, p, c, logits in zip(log.accepted, log.proposed, log.committed, log.confidence_logits):
            l = 0
            while l < p and _sigmoid(logits[l] / _temp(temperatures, l) + _bias(biases, l)) >= h:
                l += 1
            kept = min(a, l)
            taus.append(kept + (1 if kept < a or c > a else 0))  # a stop token inside the drafts has no bonus
            verified.append(l + 1)
        n = max(len(taus), 1)
        rows.append({"threshold": h, "tau": sum(taus) / n, "verified_per_round": sum(verified) / n,
                     "tau_per_verified": sum(taus) / max(sum(verified), 1)})
    return rows


def _temp(temperatures, k: int) -> float:
    if temperatures is None:
        return 1.0
    return float(temperatures[min(k, len(temperatures) - 1)])


def _bias(biases, k: int) -> float:
    if biases is None:
        return 0.0
    return float(biases[min(k, len(biases) - 1)])


def _sigmoid(x: float) -> float:
    return 0.5 * (1.0 + math.tanh(0.5 * x))


# ---- running the engine ------------------------------------------------------------------------------


class _ProposalLog:
    """An engine observer: remembers each request's proposals (tokens + raw confidence logits) in order."""

    def __init__(self):
        self.proposals: dict[str, list[tuple[list[int], list[float] | None]]] = {}

    def __call__(self, record) -> None:
        for rid, p in zip(record.request_ids, record.proposals):
            logits = None if p.confidence_logits is None else [float(x) for x in p.confidence_logits]
            self.proposals.setdefault(rid, []).append((list(p.tokens), logits))

    def forget(self, request_id: str) -> list:
        return self.proposals.pop(request_id, [])


def resize_block(drafter, block_size: int | None) -> tuple[int, bool]:
    """Block size to evaluate with, and whether it is beyond what the drafter was built for.

    Shorter blocks are the drafter's own block truncated (the engine cuts it). A longer block reconfigures
    the drafter to draft more slots (DSpark / DFlash: more MASK slots; Eagle3: a longer chain) with the
    last calibration temperature, bias and request-history weight repeated; results are flagged `block_size_extrapolated`.
    """
    gamma = drafter.block_size
    if block_size is None or block_size <= gamma:
        return (block_size or gamma), False
    if not 1 <= block_size <= 32:
        raise InvalidArgument("block_size", block_size, "must be in [1, 32]")
    cfg = drafter.config
    if cfg.kind == "eagle3":
        drafter.config = dataclasses.replace(cfg, ttt_length=block_size)
    else:
        def extend(values):
            return None if values is None else tuple(values) + (values[-1],) * (block_size - len(values))

        def extend_history(h):
            return None if h is None else dataclasses.replace(h, weights=extend(h.weights))

        drafter.config = dataclasses.replace(
            cfg, block_size=block_size, calibration_temperatures=extend(cfg.calibration_temperatures),
            calibration_temperatures_greedy=extend(cfg.calibration_temperatures_greedy),
            calibration_biases=extend(cfg.calibration_biases),
            calibration_biases_greedy=extend(cfg.calibration_biases_greedy),
            calibration_history=extend_history(cfg.calibration_history),
            calibration_history_greedy=extend_history(cfg.calibration_history_greedy))
    return block_size, True


def run_rounds(target, drafter, prompts: list[list[int]], *, block_size: int | None = None,
               temperature: float = 1.0, max_new_tokens: int = 256, seed: int = 0, concurrency: int = 32,
               stop_token_ids: tuple[int, ...] = (), progress: bool = True) -> RoundLog:
    """Decode every prompt with the fixed policy (all drafts verified) and log every round."""
    from tqdm import tqdm

    from .engine import Engine, EngineConfig
    from .sampling import SamplingParams

    if not prompts:
        raise InvalidArgument("prompts", 0, "must hold at least one prompt")
    recorder = _ProposalLog()
    # seeded requests batched (isolate_seeded=False): acceptance statistics of the target's own distribution,
    # reproducible up to the batch's rounding, at batched speed; the drafter sees the whole prompt (the paper's
    # loop, so tau stays comparable with every earlier evaluation)
    engine = Engine(target, drafter, EngineConfig(policy="fixed", block_size=block_size, max_active=concurrency,
                                                 max_waiting=len(prompts) + 1, isolate_seeded=False,
                                                 draft_window=None),
                    observer=recorder)
    log = RoundLog(confidence_logits=[] if drafter.has_confidence else None)
    order: dict[str, int] = {}
    for i, ids in enumerate(prompts):
        if len(ids) >= target.max_context - 1:
            log.skipped_prompts += 1
            continue
        params = SamplingParams(temperature=temperature, seed=seed * 1_000_003 + i, max_new_tokens=max_new_tokens,
                                stop_token_ids=tuple(stop_token_ids))
        order[engine.add_request(ids, params)] = i
    finished: dict[int, tuple] = {}
    bar = tqdm(total=len(order), desc=f"eval {getattr(drafter, 'name', '')}".strip(), unit="prompt",
               disable=not progress)
    while engine.has_work:
        for ev in engine.step():
            if ev.finished:
                req = engine.pop(ev.request_id)
                finished[order[ev.request_id]] = (req, recorder.forget(ev.request_id))
                bar.update(1)
    bar.close()
    stop = set(stop_token_ids)
    for i in sorted(finished):
        req, props = finished[i]
        assert len(props) == req.num_rounds, "one proposal per verified round"
        log.tokens += len(req.output_ids)
        for r, (a, p, (toks, logits)) in enumerate(zip(req.accepted_per_round, req.proposed_per_round, props)):
            committed = a + 1
            if a > 0 and toks[a - 1] in stop and r == req.num_rounds - 1 and req.finish_reason == "stop":
                p, committed = a, a  # an accepted stop token ends the round: later drafts were never tested
            log.accepted.append(a)
            log.proposed.append(p)
            log.committed.append(committed)
            log.prompt_index.append(i)
            if log.confidence_logits is not None:
                log.confidence_logits.append([round(x, 5) for x in logits[:p]])
    return log


def summarize(log: RoundLog, block_size: int) -> dict:
    """The contract metrics of one run."""
    hist = [0] * (block_size + 2)
    for c in log.committed:
        hist[min(c, block_size + 1)] += 1
    return {
        "tau": tau(log),
        "rounds": log.rounds,
        "tokens": log.tokens,
        "conditional_acceptance": conditional_acceptance(log.accepted, log.proposed, block_size),
        "survival": survival(log.accepted, log.proposed, block_size),
        "committed_histogram": hist,  # rounds by tokens committed, index 0..gamma+1
        "mean_proposed": sum(log.proposed) / max(log.rounds, 1),
    }


def rollouts_json(log: RoundLog) -> dict:
    """Compact per-round records (for the offline threshold sweep and re-calibration)."""
    return {"accepted": log.accepted, "proposed": log.proposed, "committed": log.committed,
            "prompt_index": log.prompt_index, "confidence_logits": log.confidence_logits}


def log_from_json(d: dict) -> RoundLog:
    return RoundLog(accepted=list(d["accepted"]), proposed=list(d["proposed"]), committed=list(d["committed"]),
                    confidence_logits=d.get("confidence_logits"), prompt_index=list(d.get("prompt_index", [])))


# ---- cost of the sequential head ----------------------------------------------------------------------


def _median_time(fn, repeats: int, warmup: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def measure_head_cost(drafter, batch_sizes=(1, 32), context_length: int = 128, repeats: int = 20,
                      warmup: int = 3, target=None, seed: int = 0, progress: bool = False) -> list[dict]:
    """Median times of one DSpark round's parts, and the share the sequential head adds over DFlash.

    Per batch size B (random context features of `context_length` positions, T = 1 sampling):
    `backbone_s` = block forward + LM head; `heads_s` = the gamma-step loop with the Markov and
    confidence heads; `no_heads_s` = the same loop with both heads removed (what DFlash runs);
    `verify_s` = one target forward carrying B * (gamma + 1) tokens (only with `target`). The head's
    extra cost is `heads_s - no_heads_s`; `share_of_round` divides it by backbone + heads + verify
    (or by the propose time alone when no target is given: `share_of_propose`).
    """
    from tqdm import tqdm

    if getattr(drafter, "kind", None) not in ("dspark", "dflash") or not hasattr(drafter, "run_heads"):
        raise InvalidArgument("drafter", getattr(drafter, "name", drafter),
                              "must be a DSpark or DFlash drafter (parallel backbone + run_heads)")
    gen = torch.Generator().manual_seed(seed)
    dev, dtype = drafter._device, drafter._dtype
    gamma, cfg = drafter.block_size, drafter.config
    bench = None
    if target is not None:
        from .profiling import VerifyStepBench

        bench = VerifyStepBench(target, context_length=context_length, block=gamma + 1, seed=seed)
    results = []
    try:
        for b in tqdm(list(batch_sizes), desc="head cost", unit="B", disable=not progress):
            states = [drafter.new_state() for _ in range(b)]
            feats = [torch.randn(context_length, cfg.feature_size, generator=gen).to(dev, dtype) for _ in range(b)]
            drafter.extend_contexts([s.cache for s in states], feats, [0] * b)
            caches = [s.cache for s in states]
            anchors = torch.randint(0, cfg.vocab_size, (b,), generator=gen).to(dev)
            positions = torch.full((b,), context_length, dtype=torch.long, device=dev)
            temps = torch.ones(b, device=dev)
            uniforms = torch.rand(b, gamma, generator=gen).to(dev)
            hidden = drafter.forward_block(caches, anchors, positions)
            base = drafter.lm_head(hidden)

            def backbone():
                drafter.lm_head(drafter.forward_block(caches, anchors, positions))

            def heads():
                drafter.run_heads(hidden, base, anchors, temps, uniforms)

            t_backbone = _median_time(backbone, repeats, warmup, dev)
            t_heads = _median_time(heads, repeats, warmup, dev)
            saved = drafter.markov_head, drafter.confidence_head
            try:
                drafter.markov_head, drafter.confidence_head = None, None
                t_none = _median_time(heads, repeats, warmup, dev)
            finally:
                drafter.markov_head, drafter.confidence_head = saved
            t_verify = None
            if bench is not None:
                t_verify = _median_time(lambda: bench(b * (gamma + 1)), repeats, warmup, target.device)
            extra = max(t_heads - t_none, 0.0)
            propose = t_backbone + t_heads
            results.append({
                "batch_size": b, "block_size": gamma, "context_length": context_length,
                "backbone_s": t_backbone, "heads_s": t_heads, "no_heads_s": t_none, "verify_s": t_verify,
                "head_extra_s": extra, "share_of_propose": extra / propose if propose > 0 else math.nan,
                "share_of_round": None if t_verify is None else extra / (propose + t_verify),
            })
    finally:
        if bench is not None:
            bench.close()
    return results
