"""Eagle3 baseline drafter: one autoregressive draft layer fed with fused target features (fixture README 4.4).

- Features of the tapped target layers are concatenated and fused by `fc` (no bias) to width H.
- The layer takes `cat(input_layernorm(embed(token)), hidden_norm(h))` (embedding half first, 2H wide)
  into q/k/v, q_norm / k_norm, RoPE; causal attention over the draft cache plus the new rows;
  `h = h + o_proj(attn)`; `h = h + mlp(post_attention_layernorm(h))`. Logits `= lm_head(norm(h))`.
- Pairing: the feature of position p goes with the token at p + 1 and uses position id p. So a request's
  committed rows are (feature p, token p+1) for p < anchor_pos, and the last row's output predicts the
  token after the anchor (draft 1).
- Chain: step k >= 1 feeds the previous step's own hidden state (no fc) with draft token d_k at position
  anchor_pos + k - 1 and predicts d_{k+1}; gamma = ttt_length tokens per round.
- Cache: only committed rows are ever stored. The chain's K/V live in a temporary tensor for the round,
  which is exactly DeepSpec's "crop the draft cache back to its pre-proposal length, then extend with the
  verify-pass features of positions start..start+a paired with the committed tokens".
- Training (`ttt_forward`, training-time test): the chain unrolled over every position of a sequence at
  once with teacher tokens; step s of row p consumes row p's own step s-1 hidden state and sees step-0
  keys of rows <= p plus its own row's keys of steps 1..s (a dense boolean mask for SDPA), which is
  exactly what `extend` + `chain` compute at inference.

Parameter names equal DeepSpec's Qwen3Eagle3Model (`fc`, `layers.0.hidden_norm`, ...; full vocabulary, no
d2t/t2d maps). Drafters know nothing about tokenization, gRPC, verification or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark_core.drafters.backbone import register_draft_vocab
from dspark_core.drafters.base import (DEFAULT_SUPPORT_SIZE, LocalStates, Proposal, ProposeItem, draw_coupling, draw_uniforms,
                                      begin_contexts, trained_features, validate_items)
from dspark_core.drafters.config import ARCH_EAGLE3, DrafterConfig
from dspark_core.drafters.dspark import _check_support_size
from dspark_core.drafters.kv_cache import KVCache, pad_caches
from dspark_core.drafters.layers import MLP, Attention, Linear, RMSNorm, RopeTable
from dspark_core.drafters.sampling import TokenChooser
from dspark_core.errors import InvalidArgument


class Eagle3Layer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        h = config.hidden_size
        self.self_attn = Attention(config, 2 * h)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, emb, h, cos, sin, past_k, past_v, mask):
        """emb, h [B, n, H]; past_k/v [B, kv, L, d]; mask [B, 1, n, L + n] or None -> (h', k, v)."""
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), dim=-1)  # [B, n, 2H]
        q, k, v = self.self_attn.query_key_value(x, cos, sin)  # k, v [B, kv, n, d]
        out = h + self.self_attn.attend(q, torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2), mask)
        out = out + self.mlp(self.post_attention_layernorm(out))
        return out, k, v


@dataclass
class Eagle3State:
    """Per-request state: K/V of committed rows (positions first..length-1) and the newest row's output."""

    cache: KVCache
    # [H] pre-norm output of the last committed row; its logits predict the token after the anchor
    last_hidden: torch.Tensor | None = None
    # the first position held (0 unless the request's context began later: `base.begin_contexts`)
    first: int = 0

    @property
    def length(self) -> int:
        return self.first + self.cache.length


@dataclass
class ChainDraft:
    # [B, gamma, H] pre-norm hidden behind each draft (row 0 = last committed row's output)
    hidden: torch.Tensor
    # [B, gamma, V]
    logits: torch.Tensor
    # [B, gamma]
    tokens: torch.Tensor
    # [B, gamma, k], None when all greedy
    support_ids: torch.Tensor | None = None
    support_probs: torch.Tensor | None = None


class Eagle3Drafter(LocalStates, nn.Module):
    kind = "eagle3"

    def __init__(self, config: DrafterConfig, support_size: int = DEFAULT_SUPPORT_SIZE, name: str | None = None):
        if config.architecture != ARCH_EAGLE3:
            raise InvalidArgument("architectures", config.architecture, f"must be {ARCH_EAGLE3} for Eagle3")
        _check_support_size(support_size)
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        # [V, H]
        self.embed_tokens = nn.Embedding(v, h)
        # [H, L * H]
        self.fc = Linear(config.feature_size, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # [V, H] (or [V_d, H]: the target's rows of the draft vocabulary)
        self.lm_head = Linear(h, config.output_size, bias=False)
        register_draft_vocab(self, config)
        self._rope = RopeTable(config.head_dim, config.rope_theta)
        self.name = name or "eagle3"
        self.support_size = min(support_size, config.output_size)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # Eagle3 has no confidence head: confidence-scheduled policies cannot run on it.
    has_confidence = False

    @property
    def block_size(self) -> int:
        return self.config.ttt_length

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def _device(self) -> torch.device:
        return self.fc.weight.device

    def _cos_sin(self, positions):
        return self._rope(positions, self.fc.weight.dtype)

    def _empty_kv(self) -> torch.Tensor:
        return self.fc.weight.new_empty(self.config.num_key_value_heads, 0, self.config.head_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def new_state(self) -> Eagle3State:
        return Eagle3State(KVCache(1))

    # ---- committed rows ---------------------------------------------------------------------------

    def extend(self, states: list[Eagle3State], features: list[torch.Tensor], tokens: list[list[int]],
               starts: list[int]) -> list[torch.Tensor]:
        """Append rows (feature p, token p+1) at positions start_i.. for each request; returns outputs [n_i, H].

        Causal within the new rows; padded rows of shorter requests are computed and discarded.
        """
        counts = [f.shape[0] for f in features]
        outputs = [self._empty_kv().new_empty(0, self.config.hidden_size) for _ in states]
        active = [i for i, n in enumerate(counts) if n]
        if not active:
            return outputs
        dev, dtype = self._device, self.fc.weight.dtype
        n_max, b = max(counts), len(active)
        feats = torch.zeros(b, n_max, self.config.feature_size, dtype=dtype, device=dev)  # [b, n_max, L * H]
        ids = torch.zeros(b, n_max, dtype=torch.long, device=dev)  # [b, n_max]
        n_rows = torch.tensor([counts[i] for i in active], device=dev)  # [b]
        for j, i in enumerate(active):
            feats[j, : counts[i]] = features[i].to(dev, dtype)
            ids[j, : counts[i]] = torch.tensor(tokens[i], dtype=torch.long, device=dev)
        positions = torch.tensor([starts[i] for i in active], device=dev)[:, None] + torch.arange(n_max, device=dev)
        cos, sin = self._cos_sin(positions)  # [b, n_max, d]
        caches = [states[i].cache for i in active]
        past_k, past_v, valid = pad_caches(caches, 0, self._empty_kv())  # [b, kv, L, d]
        ctx = torch.ones(b, n_max, past_k.shape[2], dtype=torch.bool, device=dev) if valid is None \
            else valid[:, None, :].expand(b, n_max, -1)
        row = torch.arange(n_max, device=dev)
        causal = (row[None, :] <= row[:, None])[None] & (row[None, None, :] < n_rows[:, None, None])
        padded_query = (row[None, :] >= n_rows[:, None])[:, :, None]  # [b, n_max, 1]: rows to discard
        mask = torch.cat((ctx, causal.expand(b, -1, -1)), dim=2) | padded_query  # [b, n_max, L + n_max]
        out, k, v = self.layers[0](self.embed_tokens(ids), self.fc(feats), cos, sin, past_k, past_v, mask[:, None])
        for j, i in enumerate(active):
            n = counts[i]
            states[i].cache.append(0, k[j, :, :n], v[j, :, :n])
            states[i].cache.commit(n)
            states[i].last_hidden = out[j, n - 1]
            outputs[i] = out[j, :n]
        return outputs

    # ---- the draft chain --------------------------------------------------------------------------

    def chain(self, states: list[Eagle3State], anchor_positions: torch.Tensor,
              temperatures: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
              teacher_tokens: torch.Tensor | None = None, coupling=None, processing=None) -> ChainDraft:
        """Draft gamma tokens per request without touching the committed cache.

        anchor_positions [B]; temperatures [B] (None = greedy); uniforms [B, gamma]; teacher_tokens
        [B, gamma - 1] replaces the tokens fed at steps 1..gamma-1 (teacher forcing); coupling
        (`base.Coupling`) the rows drawn by the exponential race; processing [B] `base.DraftProcessing` or
        None per row (each step chosen from the processed logits and fed on).
        """
        gamma, b, dev = self.block_size, len(states), self._device
        if temperatures is None:
            temperatures = torch.zeros(b, device=dev)
        past_k, past_v, valid = pad_caches([s.cache for s in states], 0, self._empty_kv())  # [B, kv, L, d]
        ctx_valid = valid if valid is not None else torch.ones(b, past_k.shape[2], dtype=torch.bool, device=dev)
        h = torch.stack([s.last_hidden for s in states])  # [B, H]
        hiddens, logits_out, tokens, sup_ids, sup_probs = [], [], [], [], []
        choose = TokenChooser(temperatures, self.support_size, self.config.output_size, self.draft_vocab_ids,
                              processing)
        for k in range(gamma):
            if k > 0:
                fed = teacher_tokens[:, k - 1] if teacher_tokens is not None else tokens[-1]  # [B]
                cos, sin = self._cos_sin((anchor_positions + k - 1)[:, None])  # [B, 1, d]
                mask = torch.cat((ctx_valid, torch.ones(b, k, dtype=torch.bool, device=dev)), dim=1)
                out, kk, vv = self.layers[0](self.embed_tokens(fed)[:, None], h[:, None], cos, sin,
                                             past_k, past_v, mask[:, None, None, :])
                past_k, past_v = torch.cat((past_k, kk), dim=2), torch.cat((past_v, vv), dim=2)
                h = out[:, 0]
            logits = self.logits(h)  # [B, V]
            choice = choose(logits, None if uniforms is None else uniforms[:, k],
                            None if coupling is None else coupling.at(k))
            hiddens.append(h)
            logits_out.append(logits)
            tokens.append(choice.tokens)
            sup_ids.append(choice.support_ids)
            sup_probs.append(choice.support_probs)
        sampled = sup_ids[0] is not None
        return ChainDraft(
            hidden=torch.stack(hiddens, dim=1),
            logits=torch.stack(logits_out, dim=1),
            tokens=torch.stack(tokens, dim=1),
            support_ids=choose.stacked_support(sup_ids) if sampled else None,
            support_probs=torch.stack(sup_probs, dim=1) if sampled else None,
        )

    # ---- training-time test (TTT) -------------------------------------------------------------------

    def ttt_forward(self, input_ids: torch.Tensor, features: torch.Tensor, steps: int | None = None) -> list[torch.Tensor]:
        """Unroll the chain over every row of a sequence at once, teacher-forced tokens, own hidden states.

        input_ids [B, S]; features [B, S, L * H]. Rows p = 0..S-2. Step 0 feeds (feature p, token x[p+1]) at
        position p, causally over the rows (== `extend`). Step s >= 1 feeds row p's own step s-1 hidden
        state with token x[p+1+s] at position p+s (== `chain` step s with the committed rows 0..p); its
        query sees step-0 keys of rows <= p and its own row's keys of steps 1..s. Tokens past the end are
        fed as 0 (their rows are never supervised). Returns `steps` (default ttt_length) pre-norm hidden
        states [B, S - 1, H]; step s row p predicts x[p + 2 + s]: logits = `self.logits(h)`.
        """
        steps = self.block_size if steps is None else steps
        b, s = input_ids.shape
        if s < 2:
            raise InvalidArgument("input_ids", list(input_ids.shape), "must hold at least 2 positions per row")
        if features.shape[:2] != (b, s) or features.shape[2] != self.config.feature_size:
            raise InvalidArgument("features", list(features.shape), f"must be [{b}, {s}, {self.config.feature_size}]")
        dev, n = self._device, s - 1
        ids = input_ids.to(dev)
        padded = torch.cat((ids, ids.new_zeros(b, steps)), dim=1)  # [B, S + steps]
        rows = torch.arange(n, device=dev)
        causal = rows[None, :] <= rows[:, None]  # [n, n]
        diag = torch.eye(n, dtype=torch.bool, device=dev)  # [n, n]
        layer = self.layers[0]
        h = self.fc(features[:, :n].to(dev, self.fc.weight.dtype))  # [B, n, H]
        past_k = past_v = h.new_empty(b, self.config.num_key_value_heads, 0, self.config.head_dim)
        hiddens = []
        for k in range(steps):
            cos, sin = self._cos_sin((rows + k).expand(b, n))  # [B, n, d]
            emb = self.embed_tokens(padded[:, 1 + k: 1 + k + n])  # [B, n, H]: x[p + 1 + k]
            mask = torch.cat([causal] + [diag] * k, dim=1)[None, None]  # [1, 1, n, (k + 1) n]
            h, kk, vv = layer(emb, h, cos, sin, past_k, past_v, mask)
            past_k, past_v = torch.cat((past_k, kk), dim=2), torch.cat((past_v, vv), dim=2)
            hiddens.append(h)
        return hiddens

    # ---- Drafter protocol -------------------------------------------------------------------------

    @torch.no_grad()
    def draft(self, items: list[ProposeItem]) -> ChainDraft:
        validate_items(items, Eagle3State, self.config.feature_size, self.config.vocab_size,
                       self.config.max_position_embeddings)
        begin_contexts(items)
        for i, it in enumerate(items):
            if it.new_features.shape[0] == 0 and it.state.last_hidden is None:
                raise InvalidArgument(f"items[{i}].new_features", 0, "must not be empty on the first round")
        # feature p pairs with the token at p + 1: the committed tokens shifted left, then the anchor
        tokens = [[int(t) for t in it.new_tokens[1:]] + [int(it.anchor)] if len(it.new_tokens) else []
                  for it in items]
        self.extend([it.state for it in items], [trained_features(it.new_features, self.config) for it in items],
                    tokens, [it.new_positions_start for it in items])
        dev = self._device
        positions = torch.tensor([it.anchor_pos for it in items], dtype=torch.long, device=dev)
        temperatures = torch.tensor([float(it.temperature) for it in items], dtype=torch.float32, device=dev)
        uniforms = draw_uniforms(items, self.block_size, dev)
        coupling = draw_coupling(items, self.block_size, self.config.vocab_size, dev)
        return self.chain([it.state for it in items], positions, temperatures, uniforms, coupling=coupling,
                          processing=[it.processing for it in items])

    @torch.no_grad()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out = self.draft(items)
        return [
            Proposal(
                tokens=toks,
                support_ids=out.support_ids[i] if it.temperature > 0 else None,
                support_probs=out.support_probs[i] if it.temperature > 0 else None,
                processed=it.processing is not None,
            )
            for i, (it, toks) in enumerate(zip(items, out.tokens.tolist()))
        ]
