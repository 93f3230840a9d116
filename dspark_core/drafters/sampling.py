"""Choosing one draft token per request from a slot's logits: greedy argmax or truncated sampling.

Sampling at temperature T > 0: `p = softmax(logits / T)` truncated to its top-k (k = support_size) and
renormalised (identical to a softmax over the top-k logits), then inverse-CDF sampling with a uniform the
caller drew from the request's own generator. When k covers the vocabulary the support is every id in id
order (no top-k sort), otherwise the top-k in descending probability. The support ids and their probabilities are returned
because lossless verification needs q on exactly the support the token came from. T = 0 is argmax.

Knows nothing about models or requests: rows in, tokens out.
"""

from __future__ import annotations

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


def choose_tokens(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor | None,
                  support_size: int) -> Choice:
    """logits [B, V]; temperatures [B] (0 = greedy); uniforms [B] in [0, 1) or None if all greedy."""
    greedy = logits.argmax(dim=-1)  # [B]
    if uniforms is None:
        return Choice(greedy, None, None)
    vocab = logits.shape[-1]
    k = min(support_size, vocab)
    sampled_rows = temperatures > 0  # [B]
    safe_t = torch.where(sampled_rows, temperatures, torch.ones_like(temperatures)).float()
    if k == vocab:
        # The whole vocabulary, in id order: no sort, so rows that differ only by float rounding (the same
        # request drafted alone or in a batch) keep the same support and the same inverse-CDF intervals.
        probs = torch.softmax(logits.float() / safe_t[:, None], dim=-1)  # [B, V]
        cdf = probs.cumsum(dim=-1)
        idx = torch.searchsorted(cdf, (uniforms.float() * cdf[:, -1])[:, None], right=True)  # [B, 1]
        # u * total rounding up to the total: take the last id with mass (q = 0 must never be drafted)
        ids = torch.arange(vocab, device=logits.device).expand(logits.shape[0], vocab)
        last_with_mass = torch.where(probs > 0, ids, -1).amax(dim=-1, keepdim=True)
        idx = torch.minimum(idx, last_with_mass)
        return Choice(torch.where(sampled_rows, idx.squeeze(1), greedy), ids, probs)
    top_vals, top_ids = logits.float().topk(k, dim=-1)  # [B, k]
    probs = torch.softmax(top_vals / safe_t[:, None], dim=-1)  # [B, k]
    cdf = probs.cumsum(dim=-1)  # [B, k]
    idx = torch.searchsorted(cdf, (uniforms.float() * cdf[:, -1])[:, None], right=True)  # [B, 1]
    # u * total rounding up to the total: land on the last support entry with mass (probs are sorted
    # descending, so entries with mass form a prefix); a drafted token must never have q = 0.
    last_with_mass = (probs > 0).sum(dim=-1, keepdim=True) - 1  # [B, 1]
    idx = torch.minimum(idx, last_with_mass)
    sampled = top_ids.gather(1, idx).squeeze(1)  # [B]
    return Choice(torch.where(sampled_rows, sampled, greedy), top_ids, probs)
