"""DSpark drafter: parallel backbone + sequential Markov head + confidence head (DFlash when both are absent).

One round for a batch of requests (`propose`):
1. append each request's newly committed positions to its context K/V cache (one flattened fc/k/v
   pass over all requests' new rows);
2. one backbone pass over all requests' blocks `[anchor, MASK x (gamma-1)]`, ragged contexts padded and
   masked -> h [B, gamma, H], base logits U [B, gamma, V];
3. gamma tiny sequential steps over the whole batch: `logits_k = U_k + B_k(x_{k-1}, ...)`, choose x_k
   (argmax at T = 0, else top-k truncated sampling of softmax(logits_k / T)), confidence logit
   `c_k([h_k ; W1[x_{k-1}]])`. The heads always consume the token actually chosen (sampled) at k-1.
Calibrated confidences are `sigmoid(c_k / t_k + b_k)` with the config's calibration (STS temperatures; the
biases b_k are 0 unless it was fitted by Platt scaling).

`training_forward` computes teacher-forced logits and confidence logits for many anchors per sequence
with a dense block mask (no loss: that belongs to the trainer).

Drafters know nothing about tokenization, gRPC, verification or scheduling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dspark_core.drafters.backbone import ParallelBackbone
from dspark_core.drafters.base import (DEFAULT_SUPPORT_SIZE, LocalStates, Proposal, ProposeItem, draw_coupling, draw_uniforms,
                                      begin_contexts, trained_features, validate_items)
from dspark_core.drafters.config import ARCH_DSPARK, DrafterConfig
from dspark_core.drafters.heads import ConfidenceHead, build_markov_head, markov_slot_kernel
from dspark_core.drafters.kv_cache import KVCache
from dspark_core.drafters.sampling import TokenChooser
from dspark_core.errors import InvalidArgument


@dataclass
class DSparkState:
    """Per-request drafter state: the projected context K/V of every committed position from `first`
    on (0 unless the request's context began later: `base.begin_contexts`)."""

    cache: KVCache
    first: int = 0

    @property
    def length(self) -> int:
        """Next position the drafter expects features for (first + number of cached context positions)."""
        return self.first + self.cache.length


@dataclass
class BlockDraft:
    """Everything one batched drafting round computed (for tests, diagnostics and calibration)."""

    # [B, gamma, H] backbone output after the final norm (h_k)
    hidden: torch.Tensor
    # [B, gamma, V] U_k (V_d columns with a draft vocabulary: column i is target id draft_vocab_ids[i])
    base_logits: torch.Tensor
    # [B, gamma, V] U_k + B_k (== U_k without a Markov head)
    logits: torch.Tensor
    # [B, gamma] chosen tokens x_1..x_gamma (argmax under teacher forcing)
    tokens: torch.Tensor
    # [B, gamma] previous tokens the heads consumed (anchor, then chosen / teacher tokens)
    prev_tokens: torch.Tensor
    # [B, gamma] raw confidence logits, None without a confidence head
    confidence_logits: torch.Tensor | None
    # [B, gamma, k] / [B, gamma, k] sampling support and renormalised q, None when all greedy
    support_ids: torch.Tensor | None = None
    support_probs: torch.Tensor | None = None
    # [B, gamma] raw logits of the greedy confidence output, None without one
    greedy_confidence_logits: torch.Tensor | None = None


def _check_support_size(support_size: int) -> None:
    if isinstance(support_size, bool) or not isinstance(support_size, int) or support_size < 1:
        raise InvalidArgument("support_size", support_size, "must be an integer >= 1")


class DSparkDrafter(LocalStates, ParallelBackbone):
    def __init__(self, config: DrafterConfig, support_size: int = DEFAULT_SUPPORT_SIZE, name: str | None = None):
        if config.architecture != ARCH_DSPARK:
            raise InvalidArgument("architectures", config.architecture, f"must be {ARCH_DSPARK} for DSpark/DFlash")
        _check_support_size(support_size)
        super().__init__(config)
        self.markov_head = build_markov_head(config)
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        self.name = name or config.kind
        self.support_size = min(support_size, config.output_size)

    # ---- Drafter protocol -----------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def has_confidence(self) -> bool:
        return self.confidence_head is not None

    def new_state(self) -> DSparkState:
        return DSparkState(KVCache(len(self.layers)))

    def set_calibration(self, temperatures, biases=None, history=None) -> None:
        """Install a calibration of the sampled confidence head: temperatures (one per slot; None = all 1.0),
        Platt biases (None = all 0) and a request history (dspark_core.calibration.RequestHistory, None = none)."""
        self.config = self.config.with_calibration(temperatures, biases=biases, history=history)

    def confidence_history(self, greedy: bool):
        """The request history (dspark_core.calibration.RequestHistory) that calibrates the confidences of a
        temperature-0 (`greedy`) or sampled request's proposals; None = none. Temperature-0 requests read the
        greedy output's when the drafter has one (as `propose` does)."""
        if not self.has_confidence:
            return None
        return self.config.confidence_history(greedy and self.config.greedy_confidence_head)

    @torch.no_grad()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out = self.draft(items)
        cfg = self.config
        conf_logits = out.confidence_logits
        temps, biases = self._sts_tensor(cfg.sts_temperatures), self._sts_tensor(cfg.calibration_bias_values)
        if out.greedy_confidence_logits is not None:
            # temperature-0 requests are accepted by argmax agreement: their confidences come from the greedy
            # output with its own calibration
            greedy = [it.temperature == 0 for it in items]
            g_temps = self._sts_tensor(cfg.sts_temperatures_greedy)
            g_biases = self._sts_tensor(cfg.calibration_bias_values_greedy)
            if all(greedy):
                conf_logits, temps, biases = out.greedy_confidence_logits, g_temps, g_biases
            elif any(greedy):
                rows = torch.tensor(greedy, device=conf_logits.device)[:, None]
                conf_logits = torch.where(rows, out.greedy_confidence_logits, conf_logits)
                temps, biases = torch.where(rows, g_temps, temps), torch.where(rows, g_biases, biases)
        if conf_logits is not None:
            conf_logits = conf_logits.float()  # [B, gamma]
        confidences = None if conf_logits is None else torch.sigmoid(conf_logits / temps + biases)
        proposals = []
        for i, (it, toks) in enumerate(zip(items, out.tokens.tolist())):
            sampled = it.temperature > 0
            proposals.append(Proposal(
                tokens=toks,
                support_ids=out.support_ids[i] if sampled else None,
                support_probs=out.support_probs[i] if sampled else None,
                confidences=None if confidences is None else confidences[i],
                confidence_logits=None if conf_logits is None else conf_logits[i],
                processed=it.processing is not None,
            ))
        return proposals

    def _sts_tensor(self, temperatures: tuple[float, ...]) -> torch.Tensor:
        """[gamma] float32 tensor of calibration values (temperatures or biases) on the drafter's device
        (cached per tuple)."""
        cache = self.__dict__.setdefault("_sts_cache", {})
        if temperatures not in cache:
            if len(cache) > 8:
                cache.clear()
            cache[temperatures] = torch.tensor(temperatures, dtype=torch.float32, device=self._device)
        return cache[temperatures]

    # ---- the round, in steps ----------------------------------------------------------------------

    @torch.no_grad()
    def draft(self, items: list[ProposeItem]) -> BlockDraft:
        """Extend every request's context, then draft one block per request (batched)."""
        validate_items(items, DSparkState, self.config.feature_size, self.config.vocab_size,
                       self.config.max_position_embeddings)
        begin_contexts(items)
        caches = [it.state.cache for it in items]
        self.extend_contexts(caches, [trained_features(it.new_features, self.config) for it in items],
                             [it.new_positions_start for it in items])
        dev = self._device
        anchors = torch.tensor([it.anchor for it in items], dtype=torch.long, device=dev)  # [B]
        positions = torch.tensor([it.anchor_pos for it in items], dtype=torch.long, device=dev)  # [B]
        hidden = self.forward_block(caches, anchors, positions)  # [B, gamma, H]
        temperatures = torch.tensor([float(it.temperature) for it in items], dtype=torch.float32, device=dev)
        uniforms = draw_uniforms(items, self.block_size, dev)  # [B, gamma] or None
        coupling = draw_coupling(items, self.block_size, self.config.vocab_size, dev)
        return self.run_heads(hidden, self.lm_head(hidden), anchors, temperatures, uniforms, coupling=coupling,
                              processing=[it.processing for it in items])

    def run_heads(self, hidden: torch.Tensor, base_logits: torch.Tensor, anchors: torch.Tensor,
                  temperatures: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                  teacher_prev: torch.Tensor | None = None, coupling=None, processing=None) -> BlockDraft:
        """The sequential part: gamma steps over the batch.

        hidden [B, gamma, H]; base_logits [B, gamma, V]; anchors [B]; temperatures [B] (None = greedy);
        uniforms [B, gamma] (None = all greedy); teacher_prev [B, gamma] replaces the chosen previous
        tokens (teacher forcing; slot 0's entry is normally the anchor); coupling (`base.Coupling`) the rows
        drawn by the exponential race; processing [B] `base.DraftProcessing` or None per row (each slot
        chosen from the processed logits, the Markov head fed the processed choice).
        """
        b, gamma, _ = hidden.shape
        if temperatures is None:
            temperatures = torch.zeros(b, device=hidden.device)
        markov, conf_head = self.markov_head, self.confidence_head
        if teacher_prev is None and coupling is None and not any(processing or ()):
            fast = markov_slot_kernel(markov, base_logits)
            if fast is not None:
                # the sequential loop in one call: greedy rows bitwise this loop's; sampled rows drawn from the
                # same top-k softmax by inverse CDF with the same uniforms
                if uniforms is None:
                    logits, tokens, prevs = fast(base_logits, anchors, self.draft_vocab_ids)
                    sup_ids = sup_probs = None
                else:
                    logits, tokens, prevs, sup_ids, sup_probs = fast(
                        base_logits, anchors, self.draft_vocab_ids, temperatures, uniforms,
                        min(self.support_size, base_logits.shape[-1]))
                conf = greedy_conf = None
                if conf_head is not None:
                    conf, greedy_conf = conf_head.both(hidden, markov.embed(prevs))
                return BlockDraft(hidden=hidden, base_logits=base_logits, logits=logits, tokens=tokens,
                                  prev_tokens=prevs, confidence_logits=conf, support_ids=sup_ids,
                                  support_probs=sup_probs, greedy_confidence_logits=greedy_conf)
        state = markov.start(hidden[:, 0]) if markov is not None else None
        prev = anchors  # [B]
        logits_out, tokens, prevs, prev_embs, sup_ids, sup_probs = [], [], [], [], [], []
        choose = TokenChooser(temperatures, self.support_size, base_logits.shape[-1], self.draft_vocab_ids,
                              processing)
        for k in range(gamma):
            if teacher_prev is not None:
                prev = teacher_prev[:, k]
            prevs.append(prev)
            prev_emb = markov.embed(prev) if markov is not None else None  # [B, r]
            prev_embs.append(prev_emb)
            logits = base_logits[:, k]  # [B, V]
            if markov is not None:
                bias, state = markov.step(hidden[:, k], prev_emb, state)
                logits = logits + bias
            choice = choose(logits, None if uniforms is None else uniforms[:, k],
                            None if coupling is None else coupling.at(k))
            logits_out.append(logits)
            tokens.append(choice.tokens)
            sup_ids.append(choice.support_ids)
            sup_probs.append(choice.support_probs)
            prev = choice.tokens
        conf = greedy_conf = None
        if conf_head is not None:
            # c_k reads h_k and W1[x_{k-1}] only, never the token chosen at k: all slots in one pass, after
            # the loop ([B, gamma] each; the greedy one None without a greedy output)
            conf, greedy_conf = conf_head.both(hidden, torch.stack(prev_embs, dim=1) if markov is not None else None)
        sampled = sup_ids[0] is not None
        return BlockDraft(
            hidden=hidden,
            base_logits=base_logits,
            logits=torch.stack(logits_out, dim=1),
            tokens=torch.stack(tokens, dim=1),
            prev_tokens=torch.stack(prevs, dim=1),
            confidence_logits=conf,
            support_ids=choose.stacked_support(sup_ids) if sampled else None,
            support_probs=torch.stack(sup_probs, dim=1) if sampled else None,
            greedy_confidence_logits=greedy_conf,
        )

    def teacher_forced_heads(self, hidden: torch.Tensor, base_logits: torch.Tensor,
                             teacher_prev: torch.Tensor) -> BlockDraft:
        """`run_heads` with every previous token given (teacher forcing, greedy tokens), all slots at once:
        the same outputs, without gamma per-slot passes over [B, V] tensors (training's hot path).

        hidden [B, gamma, H]; base_logits [B, gamma, V]; teacher_prev [B, gamma]."""
        markov, conf_head = self.markov_head, self.confidence_head
        prev_embs = markov.embed(teacher_prev) if markov is not None else None  # [B, gamma, r]
        logits = base_logits + markov.teacher_forced_bias(hidden, prev_embs) if markov is not None else base_logits
        conf = greedy_conf = None
        if conf_head is not None:
            conf, greedy_conf = conf_head.both(hidden, prev_embs)
        tokens = logits.argmax(-1)
        if self.draft_vocab_ids is not None:
            tokens = self.draft_vocab_ids[tokens]
        return BlockDraft(hidden=hidden, base_logits=base_logits, logits=logits, tokens=tokens,
                          prev_tokens=teacher_prev, confidence_logits=conf, support_ids=None, support_probs=None,
                          greedy_confidence_logits=greedy_conf)

    # ---- training-time forward --------------------------------------------------------------------

    def training_forward(self, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> BlockDraft:
        """Teacher-forced outputs for many anchors per sequence in one pass (dense block mask).

        input_ids [B, S]; features [B, S, L * H] (target features of every position; the block of anchor a
        only sees positions < a); anchors [B, A] with a + gamma - 1 < S. Slot k of anchor a predicts
        input_ids[a + 1 + k] and its heads consume input_ids[a + k]. Returns a BlockDraft whose tensors are
        shaped [B, A, gamma, ...] (tokens: argmax; no sampling).
        """
        gamma = self.block_size
        b, s = input_ids.shape
        if features.shape[:2] != (b, s) or features.shape[2] != self.config.feature_size:
            raise InvalidArgument("features", list(features.shape), f"must be [{b}, {s}, {self.config.feature_size}]")
        if anchors.dim() != 2 or anchors.shape[0] != b:
            raise InvalidArgument("anchors", list(anchors.shape), f"must be [{b}, num_anchors]")
        if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) + gamma - 1 >= s):
            raise InvalidArgument("anchors", anchors.tolist(), f"must lie in [0, {s - gamma}] (a + gamma - 1 < S)")
        a = anchors.shape[1]
        input_ids, anchors = input_ids.to(self._device), anchors.to(self._device)
        anchor_tokens = input_ids.gather(1, anchors)  # [B, A]
        hidden = self.forward_blocks_dense(features, anchor_tokens, anchors)  # [B, A, gamma, H]
        slots = anchors[:, :, None] + torch.arange(gamma, device=self._device)  # [B, A, gamma]
        teacher_prev = input_ids.gather(1, slots.reshape(b, a * gamma)).reshape(b * a, gamma)
        flat_hidden = hidden.reshape(b * a, gamma, -1)
        out = self.teacher_forced_heads(flat_hidden, self.lm_head(flat_hidden), teacher_prev)
        return dataclasses.replace(out, **{
            f.name: getattr(out, f.name).reshape(b, a, gamma, *getattr(out, f.name).shape[2:])
            for f in dataclasses.fields(out) if getattr(out, f.name) is not None
        })
