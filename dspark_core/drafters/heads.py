"""DSpark's sequential heads: the Markov heads that add a bias B_k to the backbone logits, and the confidence head.

Each head runs once per draft slot k, on the whole batch, given the backbone state `h_k` [B, H] and the
previous token x_{k-1} (the anchor for slot 0, then the token chosen - or teacher token - at slot k-1):
- vanilla: `B_k = W2 @ W1[x_{k-1}]`   (W1 = markov_w1 Embedding [V, r], W2 = markov_w2 Linear r -> V)
- gated:   `B_k = W2(sigmoid(gate_proj([h_k ; W1[x_{k-1}]])) * W1[x_{k-1}])`  (in DeepSpec's code, not the paper;
           not covered by the reference fixtures)
- rnn:     `z = [s ; W1[x_{k-1}] ; h_k]`, `(g, c, o) = joint_proj(z)` split in that order,
           `s <- sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c)`, `B_k = W2 @ tanh(o)`, s = 0 before slot 0
- confidence: `c_k = proj([h_k ; W1[x_{k-1}]])` (one logit; W1 part only with confidence_head_with_markov)
The confidence never looks at the token chosen at slot k, which keeps confidence-based admission causal.

Parameter names equal DeepSpec's (`markov_head.markov_w1`, `.markov_w2`, `.gate_proj`, `.joint_proj`,
`confidence_head.proj`). Knows nothing about the backbone, sampling or requests.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_core.drafters.config import DrafterConfig
from dspark_core.drafters.layers import Q8DOT_MAX_ROWS, Linear, _fused_weight, _inference, fused_linear


class VanillaMarkovHead(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        r, v = config.markov_rank, config.vocab_size
        # [V, r]: indexed by the previous token (any target id)
        self.markov_w1 = nn.Embedding(v, r)
        # [V, r] (or [V_d, r] with a draft vocabulary: a bias on the drafter's own logit columns)
        self.markov_w2 = Linear(r, config.output_size, bias=False)

    def start(self, h: torch.Tensor) -> object:
        """Recurrent state before slot 0 for h [B, H] (None: the vanilla head has none)."""
        return None

    def embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens [B] -> W1[x_{k-1}] [B, r]."""
        return self.markov_w1(prev_tokens)

    def step(self, h: torch.Tensor, prev_emb: torch.Tensor, state: object):
        """h [B, H], prev_emb [B, r] -> (bias [B, V], next state)."""
        return self.markov_w2(prev_emb), state

    def teacher_forced_bias(self, hidden: torch.Tensor, prev_embs: torch.Tensor) -> torch.Tensor:
        """All slots at once when every previous token is known (training): hidden [B, gamma, H], prev_embs
        [B, gamma, r] -> bias [B, gamma, V], equal to `step` slot by slot. One [B * gamma, r] x [r, V] matmul
        instead of gamma, and no per-slot slices of a [.., V] tensor whose backward would allocate it whole."""
        return self.markov_w2(self._pre_w2(hidden, prev_embs))

    def _pre_w2(self, hidden: torch.Tensor, prev_embs: torch.Tensor) -> torch.Tensor:
        return prev_embs


def markov_slot_kernel(markov: nn.Module | None, base_logits: torch.Tensor):
    """Our CPU kernel for the slot loop of a vanilla Markov head at inference (dspark_core.kernels markov.cpp):
    `fn(base_logits, anchors, id_map) -> (logits, tokens, prev_tokens)` for greedy rows (bitwise the Python
    loop), `fn(..., temperatures, uniforms, support)` -> the same plus the support ids / probabilities for a
    batch with sampled rows (the Python loop's TokenChooser without coupling or processing); None where it
    does not apply (another head, training, W2 not in our int8 kernel, another device)."""
    if type(markov) is not VanillaMarkovHead or markov.training or torch.is_grad_enabled():
        return None
    w2, w1 = markov.markov_w2, markov.markov_w1.weight
    if not (w2.__dict__.get("matmul_dtype") == torch.int8 and w2.__dict__.get("matmul_q8dot")) \
            or base_logits.dtype != torch.float32 or base_logits.device.type != "cpu" or w1.dtype != torch.float32 \
            or base_logits.shape[0] > Q8DOT_MAX_ROWS:
        return None
    from ..kernels import q8dot_unavailable

    if q8dot_unavailable() is not None:
        return None
    packed, _ = _fused_weight(w2, (w2,), "q8dot")
    n = packed.shape[0] * 16
    w1 = w1.contiguous()

    def run(logits: torch.Tensor, anchors: torch.Tensor, id_map: torch.Tensor | None,
            temperatures: torch.Tensor | None = None, uniforms: torch.Tensor | None = None, support: int = 0):
        """Greedy rows: (logits, tokens, prev_tokens). With uniforms (sampled rows; temperatures 0 = greedy):
        also the top-`support` support ids (target ids) and probabilities [B, gamma, support]."""
        ids = id_map if id_map is not None else torch.empty(0, dtype=torch.long)
        if uniforms is None:
            return tuple(torch.ops.dspark_cpu.markov_greedy.default(
                logits.contiguous(), w1, packed, n, anchors.long(), ids))
        return tuple(torch.ops.dspark_cpu.markov_sample.default(
            logits.contiguous(), w1, packed, n, anchors.long(), ids,
            temperatures.float().contiguous(), uniforms.float().contiguous(), support))

    return run


class GatedMarkovHead(VanillaMarkovHead):
    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        r = config.markov_rank
        # [r, H + r]
        self.gate_proj = Linear(config.hidden_size + r, r, bias=True)

    def step(self, h, prev_emb, state):
        return self.markov_w2(self._pre_w2(h, prev_emb)), state

    def _pre_w2(self, hidden, prev_embs):
        gate = torch.sigmoid(self.gate_proj(torch.cat((hidden, prev_embs), dim=-1)))  # [..., r]
        return gate * prev_embs


class RnnMarkovHead(VanillaMarkovHead):
    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        r = config.markov_rank
        self.rank = r
        # [3r, 2r + H]
        self.joint_proj = Linear(2 * r + config.hidden_size, 3 * r, bias=True)

    def start(self, h):
        return h.new_zeros(h.shape[0], self.rank)  # [B, r]

    def step(self, h, prev_emb, state):
        out, state = self._cell(h, prev_emb, state)
        return self.markov_w2(out), state

    def _cell(self, h, prev_emb, state):
        """One recurrence step on [B, r]-sized tensors -> (tanh(o) [B, r], next state)."""
        z = torch.cat((state, prev_emb, h), dim=-1)  # [B, 2r + H]
        g, c, o = self.joint_proj(z).chunk(3, dim=-1)  # 3 x [B, r]
        keep = torch.sigmoid(g)
        state = keep * state + (1 - keep) * torch.tanh(c)
        return torch.tanh(o), state

    def _pre_w2(self, hidden, prev_embs):
        state, outs = self.start(hidden[:, 0]), []
        for k in range(hidden.shape[1]):  # the recurrence stays sequential, but only over [B, r]
            out, state = self._cell(hidden[:, k], prev_embs[:, k], state)
            outs.append(out)
        return torch.stack(outs, dim=1)  # [B, gamma, r]


MARKOV_HEADS = {"vanilla": VanillaMarkovHead, "gated": GatedMarkovHead, "rnn": RnnMarkovHead}


def build_markov_head(config: DrafterConfig) -> VanillaMarkovHead | None:
    if config.markov_rank == 0:
        return None
    return MARKOV_HEADS[config.markov_head_type](config)


class ConfidenceHead(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.with_markov = config.confidence_input_size > config.hidden_size
        # [1, H (+ r)]
        self.proj = Linear(config.confidence_input_size, 1, bias=True)
        # the greedy output (same input, label 1[argmax draft == argmax target]); not in DeepSpec's format
        self.greedy = Linear(config.confidence_input_size, 1, bias=True) if config.greedy_confidence_head else None

    def forward(self, h: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        """h [B, H], prev_emb [B, r] -> raw confidence logit [B]."""
        return self.both(h, prev_emb)[0]

    def both(self, h: torch.Tensor, prev_emb: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [..., H], prev_emb [..., r] -> (sampled-regime logit [...], greedy logit [...] or None without a
        greedy output)."""
        x = torch.cat((h, prev_emb), dim=-1) if self.with_markov else h
        if self.greedy is None:
            return self.proj(x).squeeze(-1), None
        if _inference(self):  # one [2, in] matmul for both
            c, g = fused_linear(self, (self.proj, self.greedy), x).unbind(-1)
            return c, g
        return self.proj(x).squeeze(-1), self.greedy(x).squeeze(-1)
