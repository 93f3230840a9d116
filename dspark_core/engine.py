"""The multi-request speculative-decoding engine: draft -> schedule -> verify -> commit, batched.

Continuous batching: requests join (`add_request`) and leave (finish or `cancel`) between steps. One
`step()` runs, for every active request at once:
1. one batched prefill for requests that just joined (their first token is sampled from it),
2. one batched `propose` of the drafter (a block of draft tokens + confidences per request),
3. the scheduling policy: how many of each request's drafts the target verifies this step,
4. one ragged batched target forward over `[anchor, d_1..d_l]` per request, lossless verification,
   KV rollback to the accepted prefix, and the committed tokens' target features handed to the drafter.
Autoregressive decoding is the same loop with no drafter (every block is just the anchor).

Its seams (docs/architecture.md): the target, the verifier (`prefill` / `verify` / `release`), the
drafter (dspark_core.drafters.base.Drafter, with `new_state_for` / `release_state` per request), the
`policy` (built from the dspark_core.scheduling registry, or given) and the `observer`, which receives
one `StepRecord` per step. Nothing outside the engine needs to wrap or write into it.

The engine owns no threads and no I/O: `dspark generate`, the benchmark and the services drive it.
It knows nothing about text: prompts and outputs are token ids.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from . import scheduling
from .capacity import DraftCost, DraftCostFit
from .cost_model import OnlineSpsTable, SpsTable, sps_callable
from .drafters.base import DraftProcessing, Proposal, ProposeItem, context_dtype
from .errors import InvalidArgument, NotFound, ResourceExhausted
from .lookup import LookupPricing, NgramIndex, check_ngram
from .monitoring import CalibrationMonitor, CollapseDetector, RoundRecord, SlotCorrection, shift_logit
from .sampling import SamplingParams, TokenHistory, TokenLogprob, make_generator
from .target import KVCacheFull, TargetRuntime
from .verification import DraftBlock, couple_draft, process_draft
from .verifier import PrefillItem, StepResult, Verifier, VerifyItem

# log-width of the buckets in which the drafting-time EMA shares a derived cost table (~5%)
_OVERHEAD_BUCKET = 0.05

log = logging.getLogger("dspark.engine")


@dataclass(frozen=True)
class EngineConfig:
    # how many draft tokens the target may verify per request and step: a name (or alias) of the
    # dspark_core.scheduling registry ("fixed", "causal", "async", "threshold", "gamma1", "ar")
    policy: str = "fixed"
    # draft block size; None = the drafter's own
    block_size: int | None = None
    # static per-step threshold for the "threshold" policy
    confidence_threshold: float = 0.5
    # requests verified together at most; more wait in the queue
    max_active: int = 64
    # requests waiting at most before add_request refuses more (bounded queueing)
    max_waiting: int = 1024
    # DeepSpec's evaluation loop: keep drafting while the anchor's position is inside the limit, so a
    # request whose output lands exactly on max_new_tokens runs one more round (its tokens are cut).
    # Reproduces DeepSpec's per-round accepted counts; costs at most one wasted round per request.
    deepspec_rounds: bool = False
    # causal / async: count the measured drafting time as a fixed cost of every step in the SPS curve (only
    # with an SpsTable); False = the verify pass alone, the paper's theta = tau x SPS(B)
    count_draft_time: bool = True
    # correct the SPS table with every real forward pass of the in-process verifier (OnlineSpsTable); needs
    # an SpsTable. Every `explore_every` steps a causal / async step may run at a stale batch size instead.
    online_sps: bool = False
    explore_every: int = 25
    # watch calibration: when a position's running ECE (above its noise floor) exceeds this bound, the
    # confidence policies verify the fixed length until it is back under 0.7 x bound. None = off.
    calibration_bound: float | None = None
    # collapse alarm: a drafter whose position-1 acceptance falls under this fraction of its expectation
    # decodes autoregressively, with periodic one-draft probes. None = off.
    collapse_ratio: float | None = None
    # causal: verify every slot when that costs at most this fraction more step time than verifying none
    # (the budget does not bind), and look past dips of a jagged table (scheduling.causal_prefix_schedule);
    # 0 and False give the paper's literal walk
    causal_slack: float = scheduling.CAUSAL_SLACK
    causal_lookahead: bool = True
    # a seeded sampled request's output is a function of its seed alone: it runs its target pass alone (its
    # logits do not depend on what else is batched) and is verified by position-keyed coupling (its tokens do
    # not depend on how many were drafted or verified; `verification.couple_draft`). False batches it with the
    # rest and verifies it by plain speculative sampling from its seeded streams: the same distribution, a
    # higher acceptance, reproducible only for the same batches and lengths, and ~10x the throughput at batch
    # 16 on a CPU (distillation, eval and bench measure the paper's algorithm this way).
    isolate_seeded: bool = True
    # causal / async with a cost table: a request whose drafts do not pay for themselves decodes
    # autoregressively for a while instead of drafting. After each drafted round, its expected accepted drafts
    # (its confidences over the length the policy chose) are weighed against what the round spent on them (its
    # share of the drafting time plus the extra tokens in the verify pass, at the step's autoregressive rate);
    # a round that did not pay skips the request's next `draft_gate_min` steps (doubling to `draft_gate_max`
    # while it keeps not paying), then it drafts again to look. Decided from earlier rounds only, so the
    # output is untouched; False drafts for every request every step (the paper's loop).
    gate_drafts: bool = True
    # a round "does not pay" when its expected accepted drafts are below this fraction of their cost (< 1: drafts
    # near break-even keep drafting). 1.0 since 2026-12-04: SmolLM2 batch 1 at T = 1, causal / AR paired, 0.90 /
    # 0.91 at 0.75 against 0.97 / 0.96 at 1.0 on an AVX512 EPYC (a drafter round 35% of a step); greedy and the
    # Intel machine of session 19 unchanged within noise (docs/results/smollm2/README.md, "Draft gate margin")
    draft_gate_margin: float = 1.0
    draft_gate_min: int = 4
    draft_gate_max: int = 64
    # what the gate decides for. "batch" (default): whether the step runs the drafter at all, then who is in the
    # pass. A pass has a fixed cost (a drafter's launch and shared work, a drafter pod's round trip) and a small
    # one per request (capacity.DraftCostFit, fitted to the passes timed so far): each request's rounds are
    # priced at the per-request part alone, and the pass runs when the requests whose drafts pay are together
    # worth its fixed part; otherwise the step decodes without drafts, and every request probes together, in
    # one pass, on the batch's own doubling ladder. "request": each request's rounds carry their share of the
    # whole pass and each probes on its own ladder (before 2026-12-06): at concurrency 8 on SmolLM2 most passes
    # then held 1-5 requests at over half the cost of a pass for all eight (docs/results/smollm2/README.md).
    draft_gate_scope: str = "batch"
    # apply the drafter's request-history recalibration (calibration.json "request_history", if it has one): a
    # request's confidences are corrected by how its own verified rounds compared with their predictions
    # (dspark_core.calibration.RequestHistory). Only lengths move; False uses the drafter's confidences as sent.
    request_history: bool = True
    # learn the workload's level of the confidences online (monitoring.SlotCorrection): per kind of request and
    # position, a logit offset moved after each verified round by `slot_correction_rate` x (outcome -
    # prediction), added before the policy (and the request-history correction) reads them. Non-anticipating
    # (earlier rounds only); only lengths move. Off by default: with the shipped SmolLM2 DSpark drafter on held-out
    # code + math it measured neutral to negative (batch 1 paired on / off 1.013 greedy, 0.972 at T = 1 on an AMX
    # Xeon; docs/results/smollm2/README.md, "Online slot correction"): the level it fixes is a few points, and at T = 1
    # drafting does not pay on a CPU whatever the level. False reads the drafter's calibrated confidences as sent.
    slot_correction: bool = False
    slot_correction_rate: float = 0.02
    # the drafter's context of a request begins at most this many positions before its first anchor: the
    # verifier returns only the prompt's last `draft_window` positions' features and the drafter extends its
    # context over those alone (None: the whole prompt, the paper's loop). Every drafter input is a target
    # feature that already summarises the whole prefix, so acceptance barely moves (scheduling.DRAFT_WINDOW has
    # the measurements: SmolLM2 + DSpark, 64 held-out code prompts, greedy tau 2.347 -> 2.353 at 128), while a
    # request's first drafting pass (and, in distributed serving, its prefill reply) no longer grows with its
    # prompt: what a probe of a gated request costs at high concurrency.
    draft_window: int | None = scheduling.DRAFT_WINDOW
    # n-gram lookup drafts (dspark_core.lookup): when a request's longest suffix of at least `lookup_ngram` tokens
    # occurred earlier in its prompt + output, the tokens that followed it there are verified instead of the
    # drafter's block where the measured lookup table (lookup.LOOKUP_ACCEPTANCE, greedy; _SAMPLED otherwise) expects
    # them to accept more than the drafter's calibrated confidences do. Verification decides every token as before
    # (greedy: the argmax; sampled: speculative sampling against a one-point draft distribution, exact), so outputs
    # are unchanged in greedy and in distribution when sampled; only rounds' accepted counts move. 0 = off. Not
    # for sampled requests with their own processing (see Engine._lookup_draft).
    lookup_ngram: int = 0

    def __post_init__(self):
        object.__setattr__(self, "policy", scheduling.policy_spec(self.policy).name)  # aliases -> the name
        check_ngram(self.lookup_ngram)
        if self.block_size is not None and not 1 <= self.block_size <= 32:
            raise InvalidArgument("block_size", self.block_size, "must be in [1, 32]")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise InvalidArgument("confidence_threshold", self.confidence_threshold, "must be in [0, 1]")
        if self.max_active < 1:
            raise InvalidArgument("max_active", self.max_active, "must be >= 1")
        if not 0.0 <= self.causal_slack < 1.0:
            raise InvalidArgument("causal_slack", self.causal_slack, "must be in [0, 1)")
        if self.explore_every < 1:
            raise InvalidArgument("explore_every", self.explore_every, "must be >= 1")
        if self.calibration_bound is not None and not 0.0 < self.calibration_bound <= 1.0:
            raise InvalidArgument("calibration_bound", self.calibration_bound, "must be in (0, 1] or None")
        if self.collapse_ratio is not None and not 0.0 < self.collapse_ratio < 1.0:
            raise InvalidArgument("collapse_ratio", self.collapse_ratio, "must be in (0, 1) or None")
        r = self.slot_correction_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r <= 1.0:
            raise InvalidArgument("slot_correction_rate", r, "must be a number in (0, 1]")
        if not 0.0 < self.draft_gate_margin <= 1.0:
            raise InvalidArgument("draft_gate_margin", self.draft_gate_margin, "must be in (0, 1]")
        w = self.draft_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise InvalidArgument("draft_window", w, "must be None (the whole prompt) or an integer >= 1")
        if self.draft_gate_scope not in ("batch", "request"):
            raise InvalidArgument("draft_gate_scope", self.draft_gate_scope, "must be 'batch' or 'request'")
        if not 1 <= self.draft_gate_min <= self.draft_gate_max:
            raise InvalidArgument("draft_gate_min", self.draft_gate_min,
                                  f"must be in [1, draft_gate_max = {self.draft_gate_max}]")


@dataclass(eq=False)
class RequestState:
    """Everything the engine tracks for one request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    draft_generator: torch.Generator
    on_verifier: bool = False
    draft_state: object = None
    # token ids generated so far (the last one is the anchor of the next round)
    output_ids: list[int] = field(default_factory=list)
    # committed positions whose target features the drafter has not seen yet, as the verifier returned them (one
    # part a step; joined once when the drafter next runs: a gated request commits a row a step for up to
    # draft_gate_max steps on top of its prompt's, and re-joining the whole backlog every step took 4% of a
    # SmolLM2 run at T = 1, causal, concurrency 8, 200-token prompts), None before the first commit
    pending_parts: list[torch.Tensor] | None = None
    pending_start: int = 0
    pending_tokens: list[int] = field(default_factory=list)
    # tokens committed so far, including any past max_new_tokens that were cut from the output
    num_committed: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    proposed_per_round: list[int] = field(default_factory=list)
    # one per output token when the request asked for logprobs (params.logprobs is not None)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    # why a request finished with finish_reason "error" (its own bad input, found when a batch failed)
    error: BaseException | None = None
    # the client chose the seed: its output must not depend on what else runs (see _coupled)
    seeded: bool = False
    # trailing prompt tokens that were generated (an adopted request): its processing counts them as output
    generated_in_prompt: int = 0
    # the draft gate (EngineConfig.gate_drafts): the first step it drafts again, how long it skips next time,
    # and a moving average of what its drafted rounds gained over their cost (in tokens)
    draft_again_at: int = 0
    draft_gate_skip: int = 0
    draft_gate_surplus: float | None = None
    # request-history recalibration (dspark_core.calibration.RequestHistory): rounds that verified slot 1, how
    # many of them accepted it, the sum of their calibrated c_1; and this round's c_1 until it is verified
    history_rounds: int = 0
    history_accepted: int = 0
    history_confidence: float = 0.0
    slot1_confidence: float | None = None
    # n-gram lookup drafts (EngineConfig.lookup_ngram): the request's prompt + output indexed so far, and whether
    # this round verifies a lookup draft (its round then feeds no drafter statistic: calibration, collapse,
    # request history)
    lookup: NgramIndex | None = None
    lookup_round: bool = False
    lookup_match: int = 0  # this round's lookup match length
    t_start: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_end: float | None = None

    @property
    def anchor(self) -> int:
        return self.output_ids[-1]

    def history(self) -> TokenHistory:
        """Prompt and output as the request's processing counts them (adopted tokens are output)."""
        p = len(self.prompt_ids) - self.generated_in_prompt
        return TokenHistory(self.prompt_ids[:p], self.prompt_ids[p:] + self.output_ids)

    @property
    def anchor_pos(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def num_rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def pending_rows(self) -> int:
        return 0 if self.pending_parts is None else sum(int(p.shape[0]) for p in self.pending_parts)

    def take_pending_features(self) -> torch.Tensor | None:
        """The pending features as one [rows, L * H] tensor (None before the first commit); they stay pending."""
        parts = self.pending_parts
        if parts is None:
            return None
        if len(parts) > 1:
            dtype = parts[0].dtype
            parts[:] = [torch.cat([p.to(dtype) for p in parts])]
        return parts[0]

    def tokens_per_second(self) -> float:
        end = self.t_end if self.t_end is not None else time.perf_counter()
        return len(self.output_ids) / max(end - self.t_start, 1e-9)

    def speculative_metrics(self) -> dict:
        """This request's speculation so far (`speculative_metrics` of its rounds)."""
        return speculative_metrics(self.accepted_per_round, self.proposed_per_round)


def speculative_metrics(accepted_per_round: list[int], proposed_per_round: list[int]) -> dict:
    """Speculation over some rounds (of one request or several): drafts verified, drafts accepted, how many
    rounds accepted the draft at each position (index k: position k + 1), and the mean drafts verified
    per round."""
    rounds = len(accepted_per_round)
    longest = max(proposed_per_round, default=0)
    return {"num_draft_tokens": sum(proposed_per_round),
            "num_accepted_tokens": sum(accepted_per_round),
            "accepted_per_position": [sum(1 for a in accepted_per_round if a > k) for k in range(longest)],
            "mean_verification_length": sum(proposed_per_round) / rounds if rounds else 0.0,
            "num_rounds": rounds}


@dataclass(frozen=True)
class StepEvent:
    """What one step produced for one request: new token ids, and whether it finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    # one per new token when the request asked for logprobs, else None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class StepRecord:
    """What one step did, handed to the engine's `observer` at its end (one record per step).

    `request_ids` are the requests of this step's round in batch order; `proposals` (the drafter's,
    untruncated; empty without a drafter) and `lengths` (draft tokens verified) are aligned with them.
    `admitted` are the requests prefilled this step. `timings` maps each stage that ran ("prefill",
    "draft", "schedule": the policy and the verify blocks, "verify") to its (start, end) in time.time_ns().
    """

    step: int
    request_ids: tuple[str, ...]
    proposals: tuple[Proposal, ...]
    lengths: tuple[int, ...]
    admitted: tuple[str, ...]
    timings: dict[str, tuple[int, int]]
    events: tuple[StepEvent, ...]


Observer = Callable[[StepRecord], None]


class _StepLog:
    """The engine's scratch record of the step in progress (becomes a StepRecord)."""

    __slots__ = ("request_ids", "proposals", "lengths", "admitted", "timings")

    def __init__(self):
        self.request_ids: list[str] = []
        self.proposals: list[Proposal] = []
        self.lengths: list[int] = []
        self.admitted: list[str] = []
        self.timings: dict[str, tuple[int, int]] = {}

    @contextmanager
    def stage(self, name: str):
        t0 = time.time_ns()
        try:
            yield
        finally:
            self.timings[name] = (t0, time.time_ns())


def _expected_accepted(conditional: Sequence[float]) -> float:
    """Expected accepted drafts of a block verified whole, from its conditional acceptance per position."""
    expected, alive = 0.0, 1.0
    for c in conditional:
        alive *= c
        expected += alive
    return expected


def _own_fault(exc: BaseException) -> bool:
    """Whether an exception that one request's call raised is about that request's own input (a value that
    cannot work: it fails alone) rather than about capacity or availability (it may succeed later)."""
    return isinstance(exc, (ValueError, TypeError, OverflowError)) and not isinstance(exc, ResourceExhausted)


def _refused(exc: BaseException) -> bool:
    """Prefill: a request at fault, or one that no verifier has room for now, is refused alone."""
    return _own_fault(exc) or isinstance(exc, ResourceExhausted)


class Engine:
    """Runs many requests' speculative decoding over one target and at most one drafter."""

    def __init__(self, target: TargetRuntime, drafter=None, config: EngineConfig = EngineConfig(),
                 sps: Callable[[int], float] | None = None, verifier=None, policy: scheduling.Policy | None = None,
                 observer: Observer | None = None):
        """`target` may be any object with `tap_layer_ids`, `max_context` and `vocab_size` when a
        `verifier` is given: anything with Verifier's prefill / verify / release (e.g. a remote client).

        `policy`: called as policy(confidences, sps, request_ids) each round; None builds `config.policy`
        from the dspark_core.scheduling registry ("ar" without a drafter). A given policy stands in for
        `config.policy`, whose needs (a cost table, confidences) are still checked here. `observer`: called with one
        `StepRecord` at the end of every step (on the caller's thread; it must not call back into the engine).
        """
        self.target, self.drafter, self.config = target, drafter, config
        self.verifier = verifier if verifier is not None else Verifier(target, isolate_seeded=config.isolate_seeded)
        # the precision the drafter reads context features in (None: as they come; a remote drafter's pods decide)
        self._feature_dtype = context_dtype(getattr(drafter, "config", None))
        self.sps = sps
        self.observer = observer
        self.block_size = 0
        spec = scheduling.policy_spec(config.policy if drafter is not None else "ar")
        if drafter is not None:
            if tuple(drafter.target_layer_ids) != tuple(target.tap_layer_ids):
                raise InvalidArgument("tap_layer_ids", target.tap_layer_ids,
                                      f"must equal the drafter's target_layer_ids {tuple(drafter.target_layer_ids)}")
            self.block_size = config.block_size or drafter.block_size
            if spec.needs_confidence and not drafter.has_confidence:
                raise InvalidArgument("policy", config.policy,
                                      f"needs a drafter with a confidence head; {drafter.name} has none")
        if scheduling.policy_spec(config.policy).needs_sps and sps is None:
            raise InvalidArgument("policy", config.policy, "needs the target's SPS cost table (run `dspark profile`)")
        self._draft_seconds = 0.0
        # moving average of what a step spends on verification beyond the cost table's forward pass (the
        # verify call's transport to a verifier pod, acceptance, committing): a fixed cost of every step,
        # drafted or not, that the drafts of a round amortise (see _note_step_overhead)
        self._step_overhead = 0.0
        self._draft_steady = False  # a drafting pass without catch-up has been timed (see _schedule)
        self._waits_for_kv = False  # the queue's head was refused for KV room (see _admit)
        self._sps_cache: dict = {}
        self._sps_base = None  # the table _sps_cache was derived from
        self.online_sps: OnlineSpsTable | None = None
        if config.online_sps:
            if not isinstance(sps, SpsTable):
                raise InvalidArgument("online_sps", True, "needs an SpsTable prior (run `dspark profile`)")
            self.online_sps = OnlineSpsTable(sps)
            if hasattr(self.verifier, "on_forward"):
                self.verifier.on_forward = self.online_sps.observe
        self.calibration: CalibrationMonitor | None = None
        if config.calibration_bound is not None and drafter is not None and drafter.has_confidence:
            self.calibration = CalibrationMonitor(self.block_size, bound=config.calibration_bound)
        self.collapse = CollapseDetector(ratio=config.collapse_ratio) if config.collapse_ratio is not None else None
        self.correction: SlotCorrection | None = None
        if (config.slot_correction and drafter is not None and drafter.has_confidence
                and (policy is not None or spec.needs_confidence)):  # only a policy that reads them
            self.correction = SlotCorrection(self.block_size, rate=config.slot_correction_rate)
        # what the monitors decided, for the services' metrics and logs: (kind, detail dict), drained by them
        # (the last 256 are kept when nobody drains them)
        self.events: deque[tuple[str, dict]] = deque(maxlen=256)
        # rounds verified in the last step (RoundRecord per request that verified drafts, with the confidences
        # the policy read), and the same rounds with the drafter's calibrated confidences (without the online
        # slot offsets; the same list when there are none)
        self.last_rounds: list[RoundRecord] = []
        self.last_calibrated_rounds: list[RoundRecord] = []
        self.num_explored = 0  # steps run at a stale batch size for the online table
        self.num_fallback_steps = 0  # steps a confidence policy ran the fixed length (calibration off bound)
        self.num_skipped_drafts = 0  # request-rounds decoded autoregressively because the drafter collapsed
        self.num_gated_drafts = 0  # request-rounds decoded autoregressively because their drafts did not pay
        self.num_lookup_rounds = 0  # request-rounds that verified an n-gram lookup draft (EngineConfig.lookup_ngram)
        self.num_lookup_accepted = 0  # their accepted drafts
        self.lookup_pricing = LookupPricing()  # the lookup tables, corrected by the rounds verified so far
        # the gate's recent decisions per kind of request (greedy or not): a moving average of the skip it
        # assigned (0 when drafts paid), where a new request of that kind starts instead of probing from 0
        self._gate_hint = {True: 0.0, False: 0.0}
        # the batch-scope gate (EngineConfig.draft_gate_scope): the drafter's pass time as fixed + per request,
        # fitted to steady passes; the batch's probe ladder (skip, the step it probes); the tokens/s of a step
        # without drafts at the last gated round (what a pass's fixed time is worth in tokens)
        self.draft_cost = DraftCostFit()
        self._pass_skip = 0
        self._pass_again_at = 0
        self._gate_rate = 0.0
        self.num_probe_passes = 0  # passes run only to look again (batch scope), every request in them
        # a policy given by the caller may read the cost table; a registry baseline never does
        self._policy_reads_sps = policy is not None or spec.needs_sps
        if policy is None:
            opts = {}
            if spec.name == "threshold":
                opts = {"threshold": config.confidence_threshold}
            elif spec.name == "causal":
                opts = {"slack": config.causal_slack, "lookahead": config.causal_lookahead}
            policy = scheduling.make_policy(spec.name, **opts)
        self.policy = policy
        self.waiting: list[RequestState] = []
        self.active: list[RequestState] = []
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self._unreported: dict[str, list[int]] = {}  # see step()

    def _sps_for(self, requests: int):
        """The cost curve of this step: a table's row for `requests` requests when it has rows, plus the
        step's fixed cost outside the forward pass (the drafter's recent time, `_draft_seconds`), so that
        the policy maximises tokens per second of the whole step, not of the verify pass alone; and what the
        step's verification costs beyond the table's forward pass (`_step_overhead`: a verifier pod's transport,
        acceptance, committing). Both are measured, never read from the drafts, so the decision stays
        independent of the draft tokens.
        """
        table = self._table_for(requests)
        fixed = self._draft_seconds + max(0.0, self._step_overhead)
        if not isinstance(table, SpsTable) or not self.config.count_draft_time or fixed <= 0:
            return table
        # a few percent steps of overhead share one derived table per request count (the EMA moves every step)
        key = (requests, round(math.log(fixed) / _OVERHEAD_BUCKET))
        cached = self._sps_cache.get(key)
        if cached is None:
            if len(self._sps_cache) > 256:
                self._sps_cache.clear()
            cached = self._sps_cache[key] = table.with_overhead(math.exp(key[1] * _OVERHEAD_BUCKET))
        return cached

    def _table_for(self, requests: int):
        """The live cost table (the online one when on) at the step's mean context, its row for `requests`
        requests when it has rows; a caller's callable or sequence as given."""
        sps = self.sps if self.online_sps is None else self.online_sps.table(self._mean_context())
        if sps is not self._sps_base:  # a new live table (or `sps` replaced by the caller): derive afresh
            self._sps_base = sps
            self._sps_cache.clear()
        for_requests = getattr(sps, "for_requests", None)
        return sps if for_requests is None else for_requests(requests)

    def _mean_context(self) -> float:
        return sum(r.anchor_pos for r in self.active) / len(self.active) if self.active else 0.0

    # -- request lifecycle
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    generated_in_prompt: int = 0) -> str:
        """`generated_in_prompt`: how many trailing prompt tokens the request generated before (a request
        adopted from a lost scheduler): the penalties and min_tokens count them as output."""
        self.verifier.validate_prompt(prompt_ids)
        if not (isinstance(generated_in_prompt, int) and 0 <= generated_in_prompt < len(prompt_ids)):
            raise InvalidArgument("generated_in_prompt", generated_in_prompt,
                                  f"must be an integer in [0, {len(prompt_ids)}) (the prompt's length)")
        if len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(f"queue full: {len(self.waiting)} requests waiting (max_waiting)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidArgument("request_id", rid, "is already in use")
        # an unseeded request stays unseeded (its params carry no seed: the verifier draws fresh numbers and
        # may batch it freely); a seeded one draws only from streams its seed determines
        seeded = params.seed is not None
        seed = params.seed if seeded else int(torch.randint(0, 2**62, (1,)).item())
        req = RequestState(rid, list(prompt_ids), params, make_generator(seed ^ 0x5EED5EED), seeded=seeded,
                           generated_in_prompt=generated_in_prompt)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def cancel(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            raise NotFound(f"no request {request_id!r}")
        self._finish(req, "cancelled")

    def pop(self, request_id: str) -> RequestState:
        """Forget a finished request and return its final state."""
        req = self.requests.pop(request_id)
        assert req.finished, "pop() is for finished requests"
        self._unreported.pop(request_id, None)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def _finish(self, req: RequestState, reason: str) -> None:
        if req.finished:
            return
        req.finished, req.finish_reason, req.t_end = True, reason, time.perf_counter()
        if req.on_verifier:
            self.verifier.release(req.request_id)
            req.on_verifier = False
        if req.draft_state is not None:
            self.drafter.release_state(req.draft_state)
        req.draft_state = None
        if req in self.active:
            self.active.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def _emit(self, req: RequestState, tokens: list[int], stopped: bool, logprobs=None) -> list[int]:
        """Append committed tokens, honouring max_new_tokens and the context window."""
        room = req.params.max_new_tokens - len(req.output_ids)
        kept = tokens[:room]
        req.output_ids.extend(kept)
        if req.params.logprobs is not None:
            if logprobs is None or len(logprobs) != len(tokens):
                raise InvalidArgument("logprobs", None if logprobs is None else len(logprobs),
                                      f"must come with each of the {len(tokens)} committed tokens")
            req.logprobs.extend(logprobs[:room])
        req.num_committed += len(tokens)
        if req.t_first_token is None and kept:
            req.t_first_token = time.perf_counter()
        limit = req.params.max_new_tokens + (1 if self.config.deepspec_rounds and self.drafter is not None else 0)
        if stopped and len(kept) == len(tokens):
            self._finish(req, "stop")
        elif req.num_committed >= limit:
            self._finish(req, "length")
        elif len(req.prompt_ids) + len(req.output_ids) >= self.target.max_context:
            self._finish(req, "length")
        return kept

    # -- one step
    def step(self) -> list[StepEvent]:
        # tokens a step committed before it raised (a prefill, then a verify that failed) were never reported
        events, self._unreported = self._unreported, {}
        rec = _StepLog()
        # where each request's tokens of this step start (tokens a failed step left unreported come first)
        before = {r.request_id: len(r.output_ids) - len(events.get(r.request_id, ())) for r in self.active}
        try:
            self._admit(events, rec)
            if self.active:
                self._round(events, rec)
        except BaseException:
            self._unreported = events  # the next step reports them
            raise
        self.num_steps += 1
        out = []
        for rid, toks in events.items():
            req = self.requests.get(rid)
            if req is None:  # cancelled or popped meanwhile
                continue
            lps = None
            if req.params.logprobs is not None:
                start = before.get(rid, 0)
                lps = tuple(req.logprobs[start:start + len(toks)])
            out.append(StepEvent(rid, tuple(toks), req.finished, req.finish_reason, lps))
        if self.observer is not None:
            self.observer(StepRecord(self.num_steps, tuple(rec.request_ids), tuple(rec.proposals),
                                     tuple(rec.lengths), tuple(rec.admitted), rec.timings, tuple(out)))
        return out

    def _fail(self, req: RequestState, exc: BaseException, events: dict[str, list[int]]) -> None:
        """End one request whose own input made a batched call fail; the rest of the batch goes on."""
        req.error = exc
        self._finish(req, "error")
        events.setdefault(req.request_id, [])

    @staticmethod
    def _isolate(call, items: list, exc: BaseException, alone=None) -> list:
        """A batched `call(items)` raised `exc`: run each item alone and return, per item, its result or
        its exception. Re-raises `exc` when it is a failure of the call itself, not of some items: nothing
        succeeds alone and no item is at fault (`alone(e)`, default `_own_fault`: a verifier that is gone is
        nobody's fault)."""
        alone = alone or _own_fault
        if len(items) == 1:
            if alone(exc):
                return [exc]
            raise exc
        out: list = []
        for it in items:
            try:
                out.extend(call([it]))
            except Exception as e:  # noqa: BLE001 - sorted out by the caller
                out.append(e)
        if all(isinstance(o, BaseException) and not alone(o) for o in out):
            raise exc
        return out

    def _admit(self, events: dict[str, list[int]], rec: "_StepLog") -> None:
        room = self.config.max_active - len(self.active)
        if self._waits_for_kv:
            room = min(room, 1)  # the head of the queue waits for KV room: nobody overtakes it
        joining, self.waiting = self.waiting[:room], self.waiting[room:]
        if not joining:
            return
        # features only where the drafter will read them: none without one, the window's rows with one
        rows = 0 if self.drafter is None else self.config.draft_window
        items = [PrefillItem(r.request_id, tuple(r.prompt_ids), r.params, r.generated_in_prompt, rows)
                 for r in joining]
        try:
            with rec.stage("prefill"):
                try:
                    results = self.verifier.prefill(items)
                except Exception as exc:  # noqa: BLE001 - isolate the requests at fault
                    results = self._isolate(self.verifier.prefill, items, exc, _refused)
        except BaseException:
            self.waiting[:0] = joining  # nothing was admitted: they wait for the next step
            raise
        back = []
        self._waits_for_kv = False
        for req, res in zip(joining, results):
            if isinstance(res, BaseException):
                if isinstance(res, KVCacheFull) and res.fits_alone and (self.active or back):
                    # no KV room while the others run: it waits at the head of the queue until they free some
                    back.append(req)
                    self._waits_for_kv = True
                elif _refused(res):
                    self._fail(req, res, events)
                else:
                    back.append(req)  # not its fault: it tries again next step
                continue
            req.on_verifier = True
            self.active.append(req)
            rec.admitted.append(req.request_id)
            if self.drafter is not None:
                req.draft_state = self.drafter.new_state_for(req.request_id)
                start = int(self._gate_hint[req.params.greedy])
                if self._gating() and start >= self.config.draft_gate_min:
                    # like the requests of its kind that ran just before it: drafts have not been paying there
                    req.draft_gate_skip = start
                    req.draft_again_at = self._probe_step(start)
            self._commit(req, res, events)
        self.waiting[:0] = back

    def _commit(self, req: RequestState, res: StepResult, events: dict[str, list[int]]) -> None:
        """Record what the verifier committed; the drafter sees those positions' features next round."""
        if self.drafter is not None:
            feats = res.features
            if self._feature_dtype is not None and feats.dtype != self._feature_dtype:
                # kept as the drafter will read them (it rounds them to its training precision): half the memory
                # of float32 while a gated request's backlog waits
                feats = feats.to(self._feature_dtype)
            if req.pending_parts is None:
                req.pending_parts, req.pending_start = [feats], res.features_start
                req.pending_tokens = list(res.context_tokens)
            else:  # after the drafter's last round (or while it skips rounds: it catches up at its next draft)
                # a step's rows, not a view of its whole batch
                req.pending_parts.append(feats if feats is not res.features else feats.clone())
                req.pending_tokens.extend(res.context_tokens)
        kept = self._emit(req, res.tokens, res.stopped, res.logprobs)
        events.setdefault(req.request_id, []).extend(kept)

    def _round(self, events: dict[str, list[int]], rec: "_StepLog") -> None:
        reqs = list(self.active)
        rec.request_ids = [r.request_id for r in reqs]
        drafts: list[DraftBlock] = [DraftBlock(tokens=())] * len(reqs)
        confs: list[list[float]] | None = None
        if self.drafter is not None:
            if self.collapse is None or self.collapse.should_draft(self.drafter.name, self.num_steps):
                if not self._gating():
                    idx = list(range(len(reqs)))
                elif self.config.draft_gate_scope == "request":
                    idx = [i for i, r in enumerate(reqs) if r.draft_again_at <= self.num_steps]
                else:
                    idx = self._pass_members(reqs)
                self.num_gated_drafts += len(reqs) - len(idx)
                if len(idx) == len(reqs):
                    drafts, confs = self._draft(reqs, rec)
                elif idx:  # the others verify their anchor alone (or a lookup draft); their drafter catches up
                    drafted = set(idx)       # when they draft again
                    rest = [i for i in range(len(reqs)) if i not in drafted]
                    sub_drafts, sub_confs = self._draft([reqs[i] for i in idx], rec, [reqs[i] for i in rest])
                    drafts, confs = list(drafts), [[] for _ in reqs]
                    for j, i in enumerate(idx + rest):
                        drafts[i], confs[i] = sub_drafts[j], sub_confs[j]
                else:
                    drafts, confs = self._lookup_only(reqs, drafts, confs)
            else:
                self.num_skipped_drafts += len(reqs)
                drafts, confs = self._lookup_only(reqs, drafts, confs)
        rec.lengths = [len(d.tokens) for d in drafts]
        items = [VerifyItem(r.request_id, r.anchor, r.anchor_pos, d) for r, d in zip(reqs, drafts)]
        t_verify = time.perf_counter()
        failed = False
        with rec.stage("verify"):
            try:
                results = self.verifier.verify(items)
            except Exception as exc:  # noqa: BLE001 - isolate the requests at fault
                failed = True
                results = self._isolate(self.verifier.verify, items, exc)
        for req, draft, res in zip(reqs, drafts, results):
            if isinstance(res, BaseException):
                if _own_fault(res):
                    self._fail(req, res, events)
                continue  # not its fault: nothing committed, it verifies again next step
            req.accepted_per_round.append(res.num_accepted)
            req.proposed_per_round.append(len(draft.tokens))
            if req.lookup_round and draft.tokens:
                self.num_lookup_rounds += 1
                self.num_lookup_accepted += res.num_accepted
                self.lookup_pricing.observe(req.lookup_match, len(draft.tokens), res.num_accepted, req.params.greedy)
            if req.slot1_confidence is not None and draft.tokens:
                req.history_rounds += 1
                req.history_accepted += int(res.num_accepted >= 1)
                req.history_confidence += req.slot1_confidence
            self._commit(req, res, events)
        for req in reqs:
            req.slot1_confidence = None
        self.last_rounds = self.last_calibrated_rounds = []
        if confs is not None:
            self._observe(reqs, drafts, confs, results)
        for req in reqs:
            req.lookup_round = False
        if not failed:
            self._note_step_overhead(len(reqs), sum(1 + n for n in rec.lengths), time.perf_counter() - t_verify)

    def _note_step_overhead(self, requests: int, tokens: int, seconds: float) -> None:
        """Fold one step's verification time (the verify call to the end of its commit) into the moving
        average of what it spends beyond the cost table's forward pass for that many tokens. Only while the
        policy reads a table; a table dearer than the real pass gives negative samples, counted as 0."""
        if not self._policy_reads_sps or self.sps is None:
            return
        try:
            forward = 1.0 / sps_callable(self._table_for(requests))(tokens)
        except InvalidArgument:  # a caller's table that does not reach this size
            return
        self._step_overhead = 0.9 * self._step_overhead + 0.1 * (seconds - forward)

    def _observe(self, reqs, drafts, confs, results) -> None:
        """Feed the verified rounds to the calibration monitor and the collapse detector."""
        name = self.drafter.name
        rounds = [RoundRecord(name, tuple(c[:len(d.tokens)]), res.num_accepted, req.params.temperature == 0)
                  for req, d, c, res in zip(reqs, drafts, confs, results)
                  if d.tokens and not isinstance(res, BaseException) and not req.lookup_round]
        self.last_rounds = self.last_calibrated_rounds = rounds
        if self.correction is not None:
            # the drafter's own calibrated confidences (the workload offsets taken off again, before they move):
            # what the collapse alarm weighs acceptance against (offsets learned from acceptance would follow a
            # slow decay and hide it) and what `dspark calibrate --online` refits the drafter's calibration from
            undo = self.correction.apply
            self.last_calibrated_rounds = [replace(rec, confidences=tuple(undo(rec.confidences, rec.greedy, undo=True)))
                                           for rec in rounds]
            for rec in rounds:
                self.correction.observe(rec)
        if self.calibration is not None:
            for rec in rounds:
                changed = self.calibration.observe(rec)
                if changed is not None:
                    cal = self.calibration
                    detail = {"drafter": name, "ok": changed, "worst_position": cal.worst_position(),
                              "ece": [round(x, 4) for x in cal.ece], "bound": cal.bound}
                    self.events.append(("calibration", detail))
                    if changed:
                        log.info("calibration back within bound; confidence policy resumes", extra=detail)
                    else:
                        log.warning("calibration out of bound (ECE %.3f at position %s > %.3f); verifying the "
                                    "fixed length until it is back", max(x for x in cal.excess() if x == x),
                                    detail["worst_position"], cal.bound, extra=detail)
        if self.collapse is not None:
            changed = self.collapse.observe(name, self.last_calibrated_rounds, self.num_steps)
            if changed is not None:
                detail = {"drafter": name, "collapsed": changed,
                          "acceptance_ratio": self.collapse.acceptance_ratio(name)}
                self.events.append(("collapse", detail))
                if changed:
                    log.warning("drafter %s collapsed (position-1 acceptance below %.2f x expected); decoding "
                                "autoregressively with periodic probes", name, self.collapse.ratio, extra=detail)
                else:
                    log.info("drafter %s recovered; speculation resumes", name, extra=detail)

    def _draft(self, reqs: list[RequestState], rec: "_StepLog", undrafted: Sequence[RequestState] = ()
               ) -> tuple[list[DraftBlock], list[list[float]]]:
        """One batched propose; returns the verify blocks and the confidences the policy read, for `reqs` and then
        `undrafted`: the step's other requests (gated: they verify their anchor alone in the same pass, or a lookup
        draft)."""
        items = []
        for r in reqs:
            items.append(ProposeItem(
                state=r.draft_state, new_features=r.take_pending_features(), new_positions_start=r.pending_start,
                new_tokens=r.pending_tokens, anchor=r.anchor, anchor_pos=r.anchor_pos,
                temperature=r.params.temperature, generator=r.draft_generator if r.seeded else None,
                coupling_seed=r.params.seed if self._coupled(r) else None,
                processing=DraftProcessing(r.params, r.history()) if r.params.processed else None))
        # a pass that extends some request's drafter context by more than one round can commit (its prompt after
        # prefill, or the positions it skipped while gated) costs more than drafting will from then on
        catch_up = max((r.pending_rows for r in reqs), default=0) > self.block_size + 1
        start = time.perf_counter()
        with rec.stage("draft"):
            # one batched propose for every request: a seeded request's output is fixed by its seed
            # (position-keyed coupling), so batching changes at most how many of its drafts survive
            proposals = self.drafter.propose(items)
        elapsed = time.perf_counter() - start
        for r in reqs:
            # the drafter holds these now: none are sent again (a round that then commits nothing sends an empty
            # block at the anchor; what the next round commits is appended from there)
            if r.pending_parts is not None:  # an empty part of the features' width (the sent backlog is freed)
                r.pending_parts = [r.pending_parts[0].new_empty((0, r.pending_parts[0].shape[1]))]
            r.pending_start, r.pending_tokens = r.anchor_pos, []
        rec.proposals = proposals
        with rec.stage("schedule"):
            return self._schedule(reqs, proposals, rec, elapsed, catch_up, undrafted)

    def _schedule(self, reqs, proposals, rec: "_StepLog", elapsed: float, catch_up: bool = False,
                  undrafted: Sequence[RequestState] = ()) -> tuple[list[DraftBlock], list[list[float]]]:
        """The policy's lengths and the verify blocks of one drafted round (`reqs`, then `undrafted`)."""
        gamma = self.block_size
        confs = []
        history_of = getattr(self.drafter, "confidence_history", None) if self.config.request_history else None
        for r, p in zip(reqs, proposals):
            c = p.confidences
            if c is None:
                confs.append([1.0] * len(p.tokens[:gamma]))
                continue
            c = c[:gamma].tolist()
            if self.correction is not None:
                # the workload's level, learned from earlier rounds (before the request's own history, whose
                # slot-1 record then measures the request against this corrected level)
                c = self.correction.apply(c, r.params.temperature == 0)
            hist = history_of(r.params.temperature == 0) if history_of is not None and c else None
            if hist is not None:
                # the request's own verified rounds correct every position (non-anticipating: earlier rounds)
                r.slot1_confidence = c[0]
                if r.history_rounds:
                    g = hist.offset(r.history_rounds, r.history_accepted, r.history_confidence)
                    c = [shift_logit(x, w * g) for x, w in zip(c, hist.weights)]
            confs.append(c)
        # the drafter's confidences: what the draft gate weighs (a lookup draft costs nothing to make)
        gate_confs = list(confs)
        found = [self._lookup_draft(r, gamma) for r in reqs] if self.config.lookup_ngram else [([], 0)] * len(reqs)
        lookups = [d for d, _ in found]
        for i, (r, (d, n)) in enumerate(zip(reqs, found)):
            if not d:
                continue
            c = self.lookup_pricing.acceptance(n, len(d), r.params.greedy)
            # the draft expected to accept more (both priced by calibrated confidences, read before verification;
            # measured on SmolLM2 greedy code at batch 1, this beat also requiring the two drafts' first tokens to
            # agree: +4.4% / +2.9% (fixed / causal) against +1.4% / +0.8%)
            if _expected_accepted(c) <= _expected_accepted(confs[i]):
                lookups[i] = []
                continue
            confs[i] = self._take_lookup(r, d, n)
        # the policy plans the whole pass: the undrafted requests' anchors are in it (rows with no candidate).
        # Planned with the drafted requests alone, a step where most requests are gated priced its drafts on
        # the curve of a far smaller batch (a steeper one per token), so its few probes verified too little
        und_found = [self._lookup_draft(r, gamma) if self.config.lookup_ngram else ([], 0) for r in undrafted]
        und_confs = [self._take_lookup(r, d, n) for r, (d, n) in zip(undrafted, und_found)]
        all_lengths = self._lengths(confs + und_confs, [r.request_id for r in reqs] + [r.request_id for r in undrafted])
        lengths = all_lengths[:len(reqs)]
        # exponential moving average of the drafting time per step (the policies' fixed per-step cost), updated
        # after this step's schedule: a decision only ever sees earlier steps' timings. A catch-up pass (above)
        # is not what the next rounds' drafting costs: it counts only until a steady pass has been timed.
        if not catch_up:
            self.draft_cost.observe(len(reqs), elapsed)
        if not catch_up and not self._draft_steady:
            self._draft_seconds, self._draft_steady = elapsed, True
        elif not catch_up or self._draft_seconds <= 0:
            self._draft_seconds = elapsed if self._draft_seconds <= 0 else 0.8 * self._draft_seconds + 0.2 * elapsed
        if self._gating() and (not catch_up or self._draft_steady):
            # the gate weighs what drafting will cost from here: a catch-up pass is charged at the steady time
            # (before one was timed it decides nothing: a request's first round, with its whole prompt to
            # extend, would otherwise look several times dearer than drafting for it is)
            self._gate(reqs, gate_confs, lengths, self._draft_seconds if catch_up else elapsed, len(rec.request_ids))
        blocks = []
        for r, p, l, d in zip(reqs, proposals, lengths, lookups):
            # the verify block must fit in the context window: anchor + l drafts
            l = max(0, min(l, gamma, self.target.max_context - r.anchor_pos - 1))
            if d:  # a lookup draft: verified as it is (see _lookup_block)
                blocks.append(self._lookup_block(r, d, l))
                continue
            block = DraftBlock(
                tokens=tuple(p.tokens[:l]),
                support_ids=None if p.support_ids is None else p.support_ids[:l],
                support_probs=None if p.support_probs is None else p.support_probs[:l])
            if r.params.processed and not p.processed:
                # a drafter that did not process its own logits (a drafter service that predates it): the
                # drafts re-drawn from the drafter's q processed as the target will be (penalties over the
                # prefix including the drafts before each slot, min_tokens, min-p): verification then
                # compares the penalised target against exactly that processed q
                block = process_draft(block, r.params, r.history(), r.draft_generator)
            if self._coupled(r):
                # a seeded request is verified by position-keyed coupling: its drafts re-drawn with the same
                # noise survive whenever the target's draw there is the same token
                block = couple_draft(block, r.params.seed, r.anchor_pos + 1, self.target.vocab_size)
            blocks.append(block)
        for r, (d, _), l in zip(undrafted, und_found, all_lengths[len(reqs):]):
            blocks.append(self._lookup_block(r, d, l))
        return blocks, confs + und_confs

    def _take_lookup(self, r: RequestState, draft: list[int], n: int) -> list[float]:
        """`r` verifies its lookup draft this round (matched on `n` tokens): marks it (its round is not the
        drafter's: no request-history record) and returns the draft's confidences; [] without a draft."""
        if not draft:
            return []
        r.slot1_confidence = None
        r.lookup_round, r.lookup_match = True, n
        return self.lookup_pricing.acceptance(n, len(draft), r.params.greedy)

    def _lookup_block(self, r: RequestState, draft: list[int], length: int) -> DraftBlock:
        """A lookup draft cut to the policy's length and the context window. Greedy: no support. Sampled: each
        token drawn from a one-point distribution, so speculative sampling accepts it with the target's own
        probability of it and otherwise draws from the target without it (exact); a seeded request's coupled
        verification reads the tokens alone."""
        length = max(0, min(length, len(draft), self.target.max_context - r.anchor_pos - 1))
        tokens = tuple(draft[:length])
        if r.params.greedy or not tokens:
            return DraftBlock(tokens=tokens)
        return DraftBlock(tokens=tokens, support_ids=torch.tensor([[t] for t in tokens], dtype=torch.long),
                          support_probs=torch.ones(len(tokens), 1))

    def _lookup_only(self, reqs: list[RequestState], drafts: list[DraftBlock], confs
                     ) -> tuple[list[DraftBlock], list[list[float]] | None]:
        """A step without a drafter pass (gated, or a collapsed drafter): requests with a lookup draft verify it
        at the policy's lengths; unchanged when there is none (or lookup drafts are off)."""
        if not self.config.lookup_ngram:
            return drafts, confs
        found = [self._lookup_draft(r, self.block_size) for r in reqs]
        if not any(d for d, _ in found):
            return drafts, confs
        look_confs = [self._take_lookup(r, d, n) for r, (d, n) in zip(reqs, found)]
        lengths = self._lengths(look_confs, [r.request_id for r in reqs])
        return [self._lookup_block(r, d, l) for r, (d, _), l in zip(reqs, found, lengths)], look_confs

    def _lookup_draft(self, r: RequestState, k: int) -> tuple[list[int], int]:
        """An n-gram lookup draft of `k` tokens for `r` and its match length (EngineConfig.lookup_ngram), or
        ([], 0). Not for a sampled request with its own processing (penalties, min_tokens, min-p): its drafts are
        re-drawn from the processed draft distribution, which a one-point one may not survive."""
        if r.params.processed and not r.params.greedy:
            return [], 0
        idx = r.lookup
        if idx is None:
            idx = r.lookup = NgramIndex(self.config.lookup_ngram)
        prompt = len(r.prompt_ids)
        if len(idx) < prompt:
            idx.extend(r.prompt_ids[len(idx):])
        idx.extend(r.output_ids[len(idx) - prompt:])
        return idx.propose(k)

    def _gating(self) -> bool:
        """Whether the draft gate is on this step: configured, an SPS-reading policy with a table, and
        confidences the calibration monitor (if any) trusts (out of bound, the fixed length runs for all)."""
        return (self.config.gate_drafts and self._policy_reads_sps and self.sps is not None
                and (self.calibration is None or self.calibration.ok))

    def _gate(self, reqs: list[RequestState], confs: list[list[float]], lengths: list[int], draft_seconds: float,
              pass_requests: int) -> None:
        """After a drafted round: each request whose expected accepted drafts are worth less than what they
        cost skips drafting for a while (EngineConfig.gate_drafts); in batch scope, the batch's probe ladder
        moves too (see _pass_members). Reads only this round's confidences and lengths (known before
        verification) and measured times, so later rounds stay non-anticipating."""
        sps = sps_callable(self._table_for(pass_requests))
        total = pass_requests + sum(lengths)
        try:
            t_ar, t_full = 1.0 / sps(pass_requests), 1.0 / sps(total)
            without = [1.0 / sps(total - l) for l in lengths]
        except InvalidArgument:  # a caller's table that does not reach these sizes: no gating
            return
        # tokens per second of the same step without drafts (which pays the step's verification overhead too)
        rate = self._gate_rate = pass_requests / (t_ar + max(0.0, self._step_overhead))
        cfg = self.config
        batch = cfg.draft_gate_scope == "batch"
        # a request's part of the drafting: batch scope, the pass's per-request time (its fixed part is weighed
        # for the whole batch); request scope, its share of the whole pass
        share = self.pass_cost(len(reqs)).per_request if batch else draft_seconds / max(len(reqs), 1)
        for r, c, l, t_without in zip(reqs, confs, lengths, without):
            expected = _expected_accepted(c[:l])
            cost = share + max(0.0, t_full - t_without)
            # one round's confidences are a noisy guess of the next rounds': the request's moving average decides
            surplus = expected - cfg.draft_gate_margin * rate * cost
            r.draft_gate_surplus = surplus if r.draft_gate_surplus is None else \
                0.7 * r.draft_gate_surplus + 0.3 * surplus
            if r.draft_gate_surplus >= 0:
                r.draft_gate_skip = 0
            else:
                r.draft_gate_skip, r.draft_again_at = self._back_off(r.draft_gate_skip)
        if batch:
            if self._pass_pays(self.active):
                self._pass_skip = 0
            else:  # the requests whose drafts pay are not worth a pass: the batch looks again later, together
                self._pass_skip, self._pass_again_at = self._back_off(self._pass_skip)
        for r in reqs:
            # what a request of this kind skipped (in batch scope the batch's skip, when its drafts paid but the
            # batch's did not)
            skip = r.draft_gate_skip
            if batch and r.draft_gate_surplus >= 0 and self._pass_skip:
                skip = self._pass_skip
            kind = r.params.greedy
            self._gate_hint[kind] = 0.8 * self._gate_hint[kind] + 0.2 * skip

    def _pass_pays(self, reqs: Sequence[RequestState]) -> bool:
        """Whether the requests whose drafts pay (their moving surplus, tokens a round beyond their own cost) are
        together worth the fixed part of a drafter pass at the last gated round's rate (earlier rounds only)."""
        value = sum(r.draft_gate_surplus for r in reqs
                    if r.draft_gate_surplus is not None and r.draft_gate_surplus > 0)
        return value >= self.config.draft_gate_margin * self._gate_rate * self.pass_cost(len(reqs)).base

    def pass_cost(self, requests: int) -> DraftCost:
        """The drafter's pass time as fixed + per request (what the batch-scope gate weighs, and what a
        scheduler's replica plan prices drafting at): fitted to the steady passes timed so far, or, while every
        pass has been a catch-up (probes after gated stretches), the moving drafting time of a pass of
        `requests` split evenly."""
        if self.draft_cost.observed:
            return self.draft_cost.cost
        return DraftCost.from_observation(self._draft_seconds, max(1, requests))

    def _pass_members(self, reqs: list[RequestState]) -> list[int]:
        """The batch-scope gate's pass of this step (indices into `reqs`; empty: no drafter pass). The requests
        due to draft (drafts that pay, or a request's own probe) draft when those that pay are worth the pass's
        fixed cost, or when one of them has no measured round yet; otherwise nobody drafts, except on the batch's
        probe step, where every request drafts in one pass (the drafter's states catch up there, too)."""
        step = self.num_steps
        due = [i for i, r in enumerate(reqs) if r.draft_again_at <= step]
        if due and (any(reqs[i].draft_gate_surplus is None for i in due) or self._pass_pays(reqs)):
            return due
        if step >= self._pass_again_at and (due or self._pass_skip):
            self.num_probe_passes += 1
            return list(range(len(reqs)))
        return []

    def _back_off(self, skip: int) -> tuple[int, int]:
        """One more gated round on a doubling ladder (a request's, or in batch scope the batch's): the next skip,
        doubled within [draft_gate_min, draft_gate_max], and the step it probes at."""
        skip = min(self.config.draft_gate_max, max(self.config.draft_gate_min, 2 * skip))
        return skip, self._probe_step(skip)

    def _probe_step(self, skip: int) -> int:
        """The step a request skipping `skip` steps drafts again: at least `skip` steps ahead, on a multiple
        of `skip`, so that the requests at one gate level probe in the same step (one drafter pass for all of
        them, not one small pass nearly every step)."""
        earliest = self.num_steps + 1 + skip
        return -(-earliest // skip) * skip

    def _coupled(self, r: RequestState) -> bool:
        """Whether `r` is verified by position-keyed coupling (a seeded sampled request, in serving)."""
        return r.seeded and not r.params.greedy and self.config.isolate_seeded

    def _lengths(self, confs: list[list[float]], request_ids: list[str]) -> list[int]:
        """The policy's lengths, overridden by what the monitors decided from earlier steps (never from this
        step's drafts, so every override is as lossless as the fixed policy): a collapsed drafter's probe
        verifies one draft; calibration off bound runs the fixed length; and every `explore_every` steps a
        causal / async step whose reachable batch sizes include a stale one runs top-K at that size."""
        cfg = self.config
        if self.collapse is not None and self.collapse.is_collapsed(self.drafter.name):
            return scheduling.gamma1_schedule(confs)
        sps = self._sps_for(len(confs)) if self._policy_reads_sps else None
        lengths = self.policy(confs, sps, request_ids)  # always called: a stateful (async) policy stays current
        spec = scheduling.policy_spec(cfg.policy)
        if self.calibration is not None and not self.calibration.ok and spec.needs_confidence:
            self.num_fallback_steps += 1
            return scheduling.fixed_schedule(confs)
        if self.online_sps is not None and spec.needs_sps and self.num_steps % cfg.explore_every == 0:
            r = len(confs)
            stale = self.online_sps.stale_batch(r, r + sum(len(c) for c in confs), self._mean_context())
            if stale is not None and stale != r + sum(lengths):
                self.num_explored += 1
                return scheduling.async_topk_schedule(confs, stale - r)
        return lengths

    # -- convenience
    def run(self) -> None:
        while self.has_work:
            self.step()

    def generate(self, prompt_ids: list[int], params: SamplingParams, on_tokens: Callable[[list[int]], None] | None = None
                 ) -> RequestState:
        """Run one request to completion (other queued requests advance too)."""
        rid = self.add_request(prompt_ids, params)
        req = self.requests[rid]
        while not req.finished:
            for ev in self.step():
                if ev.request_id == rid and on_tokens and ev.new_token_ids:
                    on_tokens(list(ev.new_token_ids))
        return self.pop(rid)
