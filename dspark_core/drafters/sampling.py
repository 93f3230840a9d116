"""Choosing one draft token per request from a slot's logits: greedy argmax or truncated sampling.

Sampling at temperature T > 0: `p = softmax(logits / T)` truncated to its top-k (k = support_size) and
renormalised (identical to a softmax over the top-k logits), then inverse-CDF sampling with a uniform the
caller drew from the request's own generator. When k covers the vocabulary the support is every id in id
order (no top-k sort), otherwise the top-k in descending probability. The support ids and their probabilities are returned
because lossless verification needs q on exactly the support the token came from. T = 0 is argmax.

With a draft vocabulary (`id_map` [V_d]: the target id of each logit column, ascending), logits are over those
columns and everything returned (tokens, support ids) is mapped back to target ids.

A row drawn by coupling (a seeded request that verification checks by position-keyed coupling) is chosen by
the exponential race instead: argmax over its support of q / E, with E the Exp(1) noise of the slot's
position at the support's target ids (`dspark_core.sampling.coupling_noise`): the same race verification
runs on the target, so the draft survives whenever both pick the same token.

Rows with a `processing` (`base.DraftProcessing`: the request's penalties, min_tokens, min_p) are chosen from
their logits processed as verification will process the target's: the penalties over the request's history
plus the row's tokens chosen at the earlier slots of this round (the chooser remembers them), exactly as
`dspark_core.sampling.process_logits` does to the target, then min-p on the tempered distribution.

Knows nothing about models: rows in, tokens out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Choice:
    # [B] long
    tokens: torch.Tensor
    # [B, k] long, None when every row is greedy
    support_ids: torch.Tensor | None
    # [B, k] float32, None when every row is greedy
    support_probs: torch.Tensor | None


class TokenChooser:
    """`choose_tokens` for one drafting round: what depends only on the batch (which rows sample, their
    temperatures, the support ids) is worked out once, so each of the gamma slots runs only its own ops."""

    def __init__(self, temperatures: torch.Tensor, support_size: int, vocab: int,
                 id_map: torch.Tensor | None = None, processing: list | None = None):
        """temperatures [B] (0 = greedy); the vocabulary size of the logits to come; `id_map` [vocab] the
        target id of each logit column (a draft vocabulary; None = column i is id i); `processing` [B] a
        `base.DraftProcessing` or None per row."""
        self.k = min(support_size, vocab)
        self.id_map = id_map
        self.processing = [(i, p) for i, p in enumerate(processing or ()) if p is not None]
        self.drafted: dict[int, list[int]] = {i: [] for i, _ in self.processing}  # target ids chosen so far
        self._local: dict = {}  # the draft vocabulary's id -> column map, built once
        self.temps = temperatures
        sampled = temperatures > 0  # [B]
        self.sampled_rows = sampled
        self.any_greedy = not bool(sampled.all())
        self.safe_t = torch.where(sampled, temperatures, torch.ones_like(temperatures)).float()[:, None]  # [B, 1]
        # full-vocabulary support in id order (an expanded view)
        self.ids = torch.arange(vocab, device=temperatures.device).expand(temperatures.shape[0], vocab) \
            if self.k == vocab else None
        # the same support in target ids (ascending, since the map is)
        self.target_ids = self.ids if self.ids is None or id_map is None else \
            id_map.expand(temperatures.shape[0], vocab)
        # CPU cumsum is a running sum, so the inverse-CDF search below can only land on ids with mass; other
        # devices (parallel scans) get the explicit last-id-with-mass guard
        self.guard = temperatures.device.type != "cpu"

    def stacked_support(self, supports: list[torch.Tensor]) -> torch.Tensor:
        """The gamma slots' supports [B, k] as one [B, gamma, k] (a view, not a copy, for the full vocabulary)."""
        if self.ids is not None:
            return self.target_ids[:, None, :].expand(-1, len(supports), -1)
        return torch.stack(supports, dim=1)

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.id_map is None else self.id_map[ids]

    def __call__(self, logits: torch.Tensor, uniforms: torch.Tensor | None,
                 coupled: tuple[torch.Tensor, torch.Tensor] | None = None) -> Choice:
        """logits [B, V]; uniforms [B] in [0, 1) (None: every row greedy); coupled (rows [n] long, noise
        [n, vocab of target ids] float64): those sampled rows are drawn by the exponential race instead."""
        if self.processing:
            logits = self._process(logits)
        choice = self._choose(logits, uniforms, coupled)
        if self.processing:
            for i, _ in self.processing:
                self.drafted[i].append(int(choice.tokens[i]))
        return choice

    def _process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] with each processed row replaced by its processed scores (a new tensor)."""
        from dspark_core.sampling import TokenHistory, process_logits
        from dspark_core.verification import _LocalVocab

        out = logits.float().clone()
        for i, proc in self.processing:
            params, history = proc.params, proc.history
            output = list(history.output_ids) + self.drafted[i]
            row = out[i : i + 1]
            if params.history_dependent:
                if self.id_map is None:
                    row = process_logits(row, params, TokenHistory(history.prompt_ids, output))
                else:  # draft-vocabulary columns: the history re-indexed into them
                    local = _LocalVocab(self.id_map, params, history, output, self._local)
                    row = process_logits(row, local.params, local.history)
            t = float(self.temps[i])
            if params.min_p > 0.0 and t > 0:
                # q < min_p * max(q) on softmax(row / t) <=> row < max(row) + t * log(min_p)
                row = row.masked_fill(row < row.max() + t * math.log(params.min_p), -math.inf)
            if bool(torch.isfinite(row).any()):  # never a row with nothing left to choose
                out[i] = row[0]
        return out

    def _choose(self, logits: torch.Tensor, uniforms: torch.Tensor | None,
                coupled: tuple[torch.Tensor, torch.Tensor] | None) -> Choice:
        if uniforms is None:
            return Choice(self._to_target(logits.argmax(dim=-1)), None, None)
        greedy = logits.argmax(dim=-1) if self.any_greedy else None  # [B]
        if self.ids is not None:
            # The whole vocabulary, in id order: no sort, so rows that differ only by float rounding (the same
            # request drafted alone or in a batch) keep the same support and the same inverse-CDF intervals.
            probs = torch.softmax(logits.float() / self.safe_t, dim=-1)  # [B, V]
            cdf = probs.cumsum(dim=-1)
            total = cdf[:, -1:]  # [B, 1]
            # u * total may round up to the total: search strictly below it, so the id found is one where the
            # cdf steps up (q > 0: a drafted token must never have q = 0)
            point = torch.minimum(uniforms.float()[:, None] * total, torch.nextafter(total, total.new_zeros(())))
            idx = torch.searchsorted(cdf, point, right=True)  # [B, 1]
            if self.guard:
                idx = torch.minimum(idx, torch.where(probs > 0, self.ids, -1).amax(dim=-1, keepdim=True))
            tokens = idx.squeeze(1)
            support = self.ids
        else:
            top_vals, support = logits.float().topk(self.k, dim=-1)  # [B, k]
            probs = torch.softmax(top_vals / self.safe_t, dim=-1)  # [B, k]
            cdf = probs.cumsum(dim=-1)  # [B, k]
            idx = torch.searchsorted(cdf, (uniforms.float() * cdf[:, -1])[:, None], right=True)  # [B, 1]
            # u * total rounding up to the total: land on the last support entry with mass (probs are sorted
            # descending, so entries with mass form a prefix); a drafted token must never have q = 0.
            last_with_mass = (probs > 0).sum(dim=-1, keepdim=True) - 1  # [B, 1]
            tokens = support.gather(1, torch.minimum(idx, last_with_mass)).squeeze(1)  # [B]
        if coupled is not None:
            tokens = self._race(tokens, support, probs, *coupled)
        if greedy is not None:
            tokens = torch.where(self.sampled_rows, tokens, greedy)
        if self.id_map is not None:
            tokens = self.id_map[tokens]
            support = self.target_ids if self.ids is not None else self.id_map[support]
        return Choice(tokens, support, probs)


    def _race(self, tokens: torch.Tensor, support: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor,
              noise: torch.Tensor) -> torch.Tensor:
        """tokens [B] (columns) with `rows` replaced by argmax over their support of q / E."""
        cols = support[rows]  # [n, V or k] logit columns
        target = cols if self.id_map is None else self.id_map[cols]
        e = noise.gather(1, target)  # [n, V or k]
        q = probs[rows].double()
        score = torch.where(q > 0, q / e, torch.full_like(q, -1.0))
        won = cols.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)  # [n]
        tokens = tokens.clone()
        tokens[rows] = won
        return tokens


def choose_tokens(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor | None,
                  support_size: int, id_map: torch.Tensor | None = None) -> Choice:
    """logits [B, V]; temperatures [B] (0 = greedy); uniforms [B] in [0, 1) or None if all greedy."""
    return TokenChooser(temperatures, support_size, logits.shape[-1], id_map)(logits, uniforms)
