"""Training targets and losses of the drafters (algorithms.md sections 5 and 7), as *un-normalised sums*.

What lives here:
- anchor sampling (positions p with loss_mask[p] = loss_mask[p+1] = 1, up to N per sequence, seeded);
- block labels: slot j of the block at anchor p predicts x[p+1+j]; a slot is supervised only if its label
  exists, is a response token, and every earlier slot of its block is supervised (cumulative mask);
- position weights `w_j = exp(-j / decay)` for slots j = 0..gamma-1. The paper's `exp(-(k-1)/gamma)`
  (k from 1) is `decay = gamma`; DeepSpec's `exp(-k/4)` is `decay = 4`. Default: 4 (the reference code,
  which trained the released checkpoints); `LossConfig.position_decay = None` selects the paper's gamma;
- DSpark / DFlash loss sums: CE on the data token with the corrected logits U + B, TV = the full L1
  `||softmax(U+B) - p_target||_1`, and confidence BCE against the detached soft label
  `c* = 1 - 0.5 ||p_draft - p_target||_1`, each weighted by w and to be normalised by the sum of weights.
  `p_draft` in the label is the distribution inference actually *samples* from: `softmax((U+B) / T)`
  truncated to its top-k and renormalised (k = `LossConfig.confidence_support`, the drafters' sampling
  support; None = full vocabulary), against `softmax(target / T)` at the same T
  (`LossConfig.confidence_temperature`, 1.0 = the evaluation protocol). With the full-vocabulary label,
  a drafter that samples from a top-32 support is told its acceptance is far higher than what
  verification then accepts (issue #3: +18 points at slot 1 on the bundled target);
- Eagle3 training-time-test targets and soft cross-entropy per TTT step s, weighted 0.8^s.

Target distributions come from the cached final hidden states through the frozen LM head, at T = 1, only
at supervised positions (no logits are stored anywhere). With a draft vocabulary (the drafter's logits cover
only `draft_vocab_ids`), the LM head passed in is the drafter's (those rows of the target's), the target's
probabilities on those columns are `exp(logit - lse)` with the cached full-vocabulary log-partition `lse`, and
the target mass outside them (`1 - sum`) counts in TV and acceptance exactly, since the drafter puts none
there; CE skips labels outside the draft vocabulary.

Every loss returns `LossSums`: per term a numerator vector and a denominator vector (denominators
depend only on the data, never on the model). The trainer sums both over micro-batches and ranks and
divides once, so a loss is normalised over the whole global batch:
`loss = sum_terms sum_k coef[k] * num[k] / den[k]`.

Knows nothing about optimisers, processes, files or the CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark_core.errors import InvalidArgument

KINDS = ("dspark", "dspark-rnn", "dflash", "eagle3")
# DSpark defaults (algorithms.md section 5); DFlash: CE only.
DEFAULT_WEIGHTS = {"dspark": (0.1, 0.9, 1.0), "dspark-rnn": (0.1, 0.9, 1.0), "dflash": (1.0, 0.0, 0.0)}


@dataclass(frozen=True)
class LossConfig:
    """Loss weights of one drafter kind. `position_decay` None = the paper's decay (= gamma)."""

    kind: str = "dspark"
    ce_weight: float | None = None
    tv_weight: float | None = None
    confidence_weight: float | None = None
    position_decay: float | None = 4.0
    # Eagle3: weight of TTT step s is step_decay ** s
    step_decay: float = 0.8
    # confidence soft label: top-k support of the draft distribution the label assumes (None = full
    # vocabulary, the paper's formula) and the sampling temperature of draft and target in the label
    confidence_support: int | None = None
    confidence_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument("kind", self.kind, f"must be one of {list(KINDS)}")
        defaults = DEFAULT_WEIGHTS.get(self.kind, (0.0, 0.0, 0.0))
        for name, default in zip(("ce_weight", "tv_weight", "confidence_weight"), defaults):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise InvalidArgument(name, value, "must be a finite number >= 0")
        if self.position_decay is not None and (isinstance(self.position_decay, bool)
                                                or not isinstance(self.position_decay, (int, float))
                                                or not self.position_decay > 0):
            raise InvalidArgument("position_decay", self.position_decay, "must be > 0 (or None = block size)")
        if isinstance(self.step_decay, bool) or not isinstance(self.step_decay, (int, float)) \
                or not 0 < self.step_decay <= 1:
            raise InvalidArgument("step_decay", self.step_decay, "must be in (0, 1]")
        if self.confidence_support is not None and (isinstance(self.confidence_support, bool)
                                                    or not isinstance(self.confidence_support, int)
                                                    or self.confidence_support < 1):
            raise InvalidArgument("confidence_support", self.confidence_support,
                                  "must be an integer >= 1 (or None = full vocabulary)")
        t = self.confidence_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise InvalidArgument("confidence_temperature", t, "must be a finite number > 0")


@dataclass
class LossSums:
    """Per term: numerators [k] (differentiable), denominators [k] (data only), coefficients [k]."""

    num: dict[str, torch.Tensor] = field(default_factory=dict)
    den: dict[str, torch.Tensor] = field(default_factory=dict)
    coef: dict[str, torch.Tensor] = field(default_factory=dict)

    def total(self, den: dict[str, torch.Tensor] | None = None, scale: float = 1.0) -> torch.Tensor:
        """sum_terms sum_k coef * num / den (den defaults to this object's own: a local mean)."""
        den = self.den if den is None else den
        parts = [(self.coef[k] * self.num[k] / den[k].clamp_min(1e-6)).sum() for k in self.num]
        return torch.stack(parts).sum() * scale

    def values(self, den: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """One number per term for logging: sum_k coef_k num_k / den_k / sum_k coef_k (a weighted mean)."""
        den = self.den if den is None else den
        out = {}
        for k in self.num:
            ratio = self.num[k].detach() / den[k].clamp_min(1e-6)
            c = self.coef[k]
            out[k] = float((c * ratio).sum() / c.sum()) if float(c.sum()) > 0 else float(ratio.mean())
        return out


# ---- anchors and block targets (DSpark / DFlash) -------------------------------------------------


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None,
                   max_position: int | None = None) -> torch.Tensor:
    """loss_mask [S] bool -> sorted anchor positions [A <= max_anchors] with mask[p] = mask[p+1] = 1.

    `max_position` bounds p (inclusive), e.g. S - gamma for a forward that needs the whole block inside
    the sequence. Without a generator the first `max_anchors` candidates are taken.
    """
    if max_anchors < 1:
        raise InvalidArgument("num_anchors", max_anchors, "must be >= 1")
    m = loss_mask.bool()
    ok = m[:-1] & m[1:]  # [S - 1]
    if max_position is not None:
        ok[max_position + 1:] = False
    candidates = ok.nonzero().flatten()
    if candidates.numel() > max_anchors:
        if generator is None:
            candidates = candidates[:max_anchors]
        else:
            pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
            candidates = candidates[pick].sort().values
    return candidates


def position_weights(gamma: int, decay: float | None) -> torch.Tensor:
    """[gamma] w_j = exp(-j / decay), j = 0..gamma-1; decay None = gamma (the paper's form)."""
    d = float(gamma if decay is None else decay)
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / d)


@dataclass
class BlockTargets:
    """Labels and weights of a [B, A] grid of blocks."""

    # [B, A, gamma] long: x[p + 1 + j] (0 where it does not exist)
    labels: torch.Tensor
    # [B, A, gamma] bool: cumulative supervision mask
    supervised: torch.Tensor
    # [B, A, gamma] float32: position weight where supervised, else 0
    weights: torch.Tensor


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                  anchor_valid: torch.Tensor, gamma: int, decay: float | None) -> BlockTargets:
    """input_ids, loss_mask [B, S] (loss_mask False on padding); anchors, anchor_valid [B, A]."""
    b, s = input_ids.shape
    pos = anchors[:, :, None] + 1 + torch.arange(gamma, device=anchors.device)  # [B, A, gamma]
    inside = pos < s
    safe = pos.clamp_max(s - 1).reshape(b, -1)
    labels = input_ids.gather(1, safe).reshape(pos.shape)
    ok = inside & loss_mask.bool().gather(1, safe).reshape(pos.shape) & anchor_valid[:, :, None]
    supervised = ok.long().cumprod(dim=-1).bool()  # every earlier slot supervised too
    labels = torch.where(supervised, labels, torch.zeros_like(labels))
    weights = supervised.float() * position_weights(gamma, decay).to(anchors.device)
    return BlockTargets(labels=labels, supervised=supervised, weights=weights)


def block_target_positions(anchors: torch.Tensor, gamma: int) -> torch.Tensor:
    """[B, A] -> [B, A, gamma]: the position whose final hidden state gives slot j's target (p + j)."""
    return anchors[:, :, None] + torch.arange(gamma, device=anchors.device)


def target_logits(final_hidden: torch.Tensor, positions: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """final_hidden [B, S, H], positions [N, 2] (batch, position) -> target logits [N, V] (float32, no grad)."""
    with torch.no_grad():
        h = final_hidden[positions[:, 0], positions[:, 1]]  # [N, H]
        return F.linear(h.to(lm_head_weight.dtype), lm_head_weight).float()


def target_probs(t_logits: torch.Tensor, positions: torch.Tensor, target_lse: torch.Tensor | None) -> torch.Tensor:
    """[N, V'] target probabilities on the logit columns: a softmax (whole vocabulary), or, with the cached
    full-vocabulary log-partition `target_lse` [B, S] (a draft vocabulary), `exp(logit - lse)` (rows sum to
    the target's mass inside the draft vocabulary, <= 1)."""
    if target_lse is None:
        return torch.softmax(t_logits, -1)
    lse = target_lse[positions[:, 0], positions[:, 1]].float()[:, None]
    return torch.exp(t_logits - lse).clamp_max(1.0)


def label_columns(labels: torch.Tensor, draft_vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids [N] -> (their logit columns [N], in the draft vocabulary [N] bool); identity without one."""
    if draft_vocab_ids is None:
        return labels, torch.ones_like(labels, dtype=torch.bool)
    col = torch.searchsorted(draft_vocab_ids, labels).clamp_max(draft_vocab_ids.numel() - 1)
    inside = draft_vocab_ids[col] == labels
    return torch.where(inside, col, torch.zeros_like(col)), inside


def acceptance_probability(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0,
                           support: int | None = None, p_target: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] x [N, V] -> [N]: `1 - 0.5 ||q - p||_1` = `sum_x min(p(x), q(x))`, the probability that
    speculative sampling accepts a token drawn from q, where q = softmax(draft / T) truncated to its top
    `support` entries and renormalised (exactly what `drafters.sampling.choose_tokens` samples from; None =
    full vocabulary) and p = softmax(target / T), or `p_target` as given (T = 1 probabilities on the columns,
    e.g. `target_probs` of a draft vocabulary: mass outside them never meets q). No gradient."""
    with torch.no_grad():
        d = draft_logits.float() / temperature
        p = torch.softmax(target_logits.float() / temperature, dim=-1) if p_target is None else p_target
        if support is None or support >= d.shape[-1]:
            q = torch.softmax(d, dim=-1)
        else:
            vals, ids = d.topk(support, dim=-1)
            q = torch.zeros_like(d).scatter_(-1, ids, torch.softmax(vals, dim=-1))
        outside = (1.0 - p.sum(dim=-1)).clamp_min(0.0)  # target mass q never covers (0 on a full vocabulary)
        return (1.0 - 0.5 * ((q - p).abs().sum(dim=-1) + outside)).clamp(0.0, 1.0)


def dspark_loss_sums(logits: torch.Tensor, confidence_logits: torch.Tensor | None, targets: BlockTargets,
                     final_hidden: torch.Tensor, anchors: torch.Tensor, lm_head_weight: torch.Tensor,
                     config: LossConfig, greedy_confidence_logits: torch.Tensor | None = None,
                     draft_vocab_ids: torch.Tensor | None = None,
                     target_lse: torch.Tensor | None = None) -> LossSums:
    """DSpark / DFlash loss sums for one micro-batch.

    logits [B, A, gamma, V] corrected draft logits U + B (teacher forced); confidence_logits [B, A, gamma]
    or None; final_hidden [B, S, H] cached target states; lm_head_weight [V, H] the frozen head.
    Terms: ce, tv, conf (each num = sum w * loss, den = sum w) and `accept` (mean soft label, coef 0).
    The soft label is `acceptance_probability` with the config's confidence support and temperature.
    With `greedy_confidence_logits` [B, A, gamma], also `gconf`: BCE against the greedy acceptance
    1[argmax draft == argmax target] (what verification accepts at temperature 0), weight as `conf`.
    With a draft vocabulary (`draft_vocab_ids` [V_d], logits over those columns), `target_lse` [B, S] is
    required (see the module docstring); the target's argmax counts as inside the draft vocabulary only when
    its best column there holds more than the mass outside (a sufficient condition: else a miss).
    """
    if draft_vocab_ids is not None and target_lse is None:
        raise InvalidArgument("target_lse", None, "is required with a draft vocabulary (TargetCache.ensure_target_lse)")
    gamma = logits.shape[2]
    sel = targets.supervised  # [B, A, gamma]
    idx = sel.nonzero()  # [N, 3] (b, a, j)
    w = targets.weights[sel]  # [N]
    den = w.sum().detach().reshape(1)
    draft = logits[sel].float()  # [N, V]
    sums = LossSums()

    def add(name: str, per_token: torch.Tensor, coef: float) -> None:
        sums.num[name] = (per_token * w).sum().reshape(1)
        sums.den[name] = den
        sums.coef[name] = torch.tensor([float(coef)], device=den.device)

    cols, inside = label_columns(targets.labels[sel], draft_vocab_ids)
    add("ce", F.cross_entropy(draft, cols, reduction="none") * inside, config.ce_weight)
    need_target = config.tv_weight > 0 or confidence_logits is not None or greedy_confidence_logits is not None
    if need_target:
        pos = block_target_positions(anchors, gamma)[sel]  # [N]
        where = torch.stack((idx[:, 0], pos), 1)
        t_logits = target_logits(final_hidden, where, lm_head_weight)
        p_target = target_probs(t_logits, where, target_lse)
        outside = None if target_lse is None else (1.0 - p_target.sum(-1)).clamp_min(0.0)  # [N]
        l1 = (torch.softmax(draft, dim=-1) - p_target).abs().sum(dim=-1)  # [N], in [0, 2]
        if outside is not None:
            l1 = l1 + outside
        if config.tv_weight > 0:
            add("tv", l1, config.tv_weight)
        if config.confidence_support is None and config.confidence_temperature == 1.0:
            soft_label = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)  # c* (acceptance probability)
        else:  # c* of the distribution inference samples from (top-k support, temperature T)
            if target_lse is not None and config.confidence_temperature != 1.0:
                raise InvalidArgument("confidence_temperature", config.confidence_temperature,
                                      "must be 1.0 with a draft vocabulary (the cached log-partition is at T = 1)")
            soft_label = acceptance_probability(draft.detach(), t_logits, config.confidence_temperature,
                                                config.confidence_support,
                                                p_target=None if target_lse is None else p_target)
        add("accept", soft_label, 0.0)
        if confidence_logits is not None:
            conf = confidence_logits[sel].float()
            add("conf", F.binary_cross_entropy_with_logits(conf, soft_label, reduction="none"),
                config.confidence_weight)
        if greedy_confidence_logits is not None:
            hit = draft.detach().argmax(-1) == t_logits.argmax(-1)
            if outside is not None:  # the target's argmax surely lies in the draft vocabulary
                hit = hit & (p_target.max(-1).values > outside)
            hit = hit.float()
            add("gconf", F.binary_cross_entropy_with_logits(greedy_confidence_logits[sel].float(), hit,
                                                            reduction="none"), config.confidence_weight)
    return sums


def block_denominators(targets: BlockTargets, sums_keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The denominators `dspark_loss_sums` will report, from the data alone (for global normalisation)."""
    den = targets.weights.sum().reshape(1)
    return {k: den for k in sums_keys}


def dspark_term_names(config: LossConfig, has_confidence: bool, has_greedy: bool = False) -> tuple[str, ...]:
    names = ["ce"]
    if config.tv_weight > 0:
        names.append("tv")
    if config.tv_weight > 0 or has_confidence:
        names.append("accept")
    if has_confidence:
        names.append("conf")
    if has_greedy:
        names.append("gconf")
    return tuple(names)


# ---- Eagle3 training-time test -----------------------------------------------------------------


@dataclass
class TTTTargets:
    """Supervision of an Eagle3 TTT unroll over rows p = 0..S-2 (feature p with token p+1)."""

    # [B, gamma, S - 1] bool: step s of row p predicts x[p + 2 + s]; cumulative over s
    mask: torch.Tensor


def ttt_targets(loss_mask: torch.Tensor, gamma: int) -> TTTTargets:
    """loss_mask [B, S] (False on padding) -> TTTTargets."""
    b, s = loss_mask.shape
    n = s - 1
    m = loss_mask.bool()
    steps = []
    for k in range(gamma):
        shifted = torch.zeros(b, n, dtype=torch.bool, device=m.device)
        lo = 2 + k  # row p predicts position p + 2 + k
        if lo < s:
            shifted[:, : s - lo] = m[:, lo:]
        steps.append(shifted)
    mask = torch.stack(steps, dim=1).long().cumprod(dim=1).bool()  # [B, gamma, n]
    return TTTTargets(mask=mask)


def ttt_denominators(targets: TTTTargets) -> dict[str, torch.Tensor]:
    return {"soft_ce": targets.mask.float().sum(dim=(0, 2))}  # [gamma]


def eagle3_loss_sums(step_logits: list[torch.Tensor], targets: TTTTargets, final_hidden: torch.Tensor,
                     lm_head_weight: torch.Tensor, config: LossConfig,
                     target_lse: torch.Tensor | None = None) -> LossSums:
    """Soft cross-entropy of each TTT step to the target distribution, step weights step_decay ** s.

    step_logits: gamma tensors [B, S - 1, V] (step s, row p predicts x[p + 2 + s], whose target
    distribution is the target's output at position p + 1 + s). With a draft vocabulary, `target_lse`
    [B, S] gives the target's probabilities on the drafter's columns (soft CE over them; the mass outside
    counts in `accept`).
    """
    gamma = len(step_logits)
    nums, accept = [], []
    for k, logits in enumerate(step_logits):
        sel = targets.mask[:, k]  # [B, n]
        idx = sel.nonzero()  # [N, 2]
        if idx.numel() == 0:
            nums.append(logits.sum() * 0.0)
            accept.append(logits.new_zeros(()).detach())
            continue
        pos = idx[:, 1] + 1 + k
        where = torch.stack((idx[:, 0], pos), 1)
        p_target = target_probs(target_logits(final_hidden, where, lm_head_weight), where, target_lse)
        outside = (1.0 - p_target.sum(-1)).clamp_min(0.0) if target_lse is not None else 0.0
        logq = torch.log_softmax(logits[sel].float(), dim=-1)  # [N, V]
        nums.append(-(p_target * logq).sum(dim=-1).sum())
        accept.append((1 - 0.5 * ((logq.detach().exp() - p_target).abs().sum(-1) + outside)).clamp(0, 1).sum())
    den = ttt_denominators(targets)["soft_ce"].detach()
    coef = config.step_decay ** torch.arange(gamma, dtype=torch.float32, device=den.device)
    return LossSums(num={"soft_ce": torch.stack(nums), "accept": torch.stack(accept)},
                    den={"soft_ce": den, "accept": den},
                    coef={"soft_ce": coef, "accept": torch.zeros_like(coef)})
