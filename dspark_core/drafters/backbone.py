"""DFlash-style parallel backbone: one forward pass drafts a whole block from injected target context.

What it computes (algorithms.md section 2, fixture README 4.2):
- context: `ctx = hidden_norm(fc(features))` for committed positions; every draft layer projects ctx
  with its own k_proj / v_proj (no input layernorm), k_norm, RoPE at the context positions. Only these
  context K/V are cached across rounds (one `KVCache` per request).
- block: `[anchor, MASK x (gamma-1)]` at positions anchor_pos .. anchor_pos+gamma-1, embedded with the
  (target's) `embed_tokens`. Queries come only from the block; keys/values are [context ; block]. At
  inference there is no mask beyond padding: each slot sees all context and its whole block. The
  block's own K/V are never stored, so they are "dropped" after each round.
- `h_k = norm(last layer output)`, base logits `U_k = lm_head(h_k)`.
- training: many anchors per sequence at once with a dense block attention mask
  (block of anchor a sees context positions < a and its own block, bidirectionally).

Parameter names equal DeepSpec's (`embed_tokens`, `fc`, `hidden_norm`, `layers.N.*`, `norm`, `lm_head`).
Knows nothing about Markov / confidence heads, sampling or requests.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_core.drafters.config import DrafterConfig
from dspark_core.drafters.kv_cache import KVCache, pad_caches
from dspark_core.drafters.layers import DecoderLayer, Linear, RMSNorm, RopeTable


def _fill_room(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Write the block's k, v [B, kv, n, d] into the last n rows of keys / values; return them."""
    n = k.shape[2]
    keys[:, :, -n:] = k
    values[:, :, -n:] = v
    return keys, values


def register_draft_vocab(module: nn.Module, config: DrafterConfig) -> None:
    """`module.draft_vocab_ids`: [V_d] int64 target ids of the logit columns (ascending; a weight of the
    checkpoint), or None without a draft vocabulary."""
    ids = torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None
    module.register_buffer("draft_vocab_ids", ids, persistent=True)


class ParallelBackbone(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        # [V, H]
        self.embed_tokens = nn.Embedding(v, h)
        # [H, L * H]
        self.fc = Linear(config.feature_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # [V, H] (or [V_d, H]: the target's rows of the draft vocabulary)
        self.lm_head = Linear(h, config.output_size, bias=False)
        register_draft_vocab(self, config)
        self._rope = RopeTable(config.head_dim, config.rope_theta)

    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def _device(self) -> torch.device:
        return self.fc.weight.device

    def _cos_sin(self, positions: torch.Tensor):
        return self._rope(positions, self._dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., L * H] -> ctx [..., H]."""
        return self.hidden_norm(self.fc(features.to(self._device, self._dtype)))

    def extend_contexts(self, caches: list[KVCache], features: list[torch.Tensor], starts: list[int]) -> None:
        """Append every layer's context K/V for each request's new rows (features[i] [n_i, L * H])."""
        counts = [f.shape[0] for f in features]
        if sum(counts) == 0:
            return
        # ragged batch flattened: [N, L * H] plus per-request counts
        if len(features) == 1:
            flat = features[0].to(self._device, self._dtype)
            positions = torch.arange(starts[0], starts[0] + counts[0], device=self._device)  # [N]
        else:
            flat = torch.cat([f.to(self._device, self._dtype) for f in features])
            positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)]).to(self._device)
        ctx = self.project_context(flat)[None]  # [1, N, H]
        cos, sin = self._cos_sin(positions[None])  # [1, N, d]
        for li, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)  # [1, kv, N, d]
            for cache, kk, vv in zip(caches, k[0].split(counts, dim=1), v[0].split(counts, dim=1)):
                if kk.shape[1]:
                    cache.append(li, kk, vv)
        for cache, n in zip(caches, counts):
            cache.commit(n)

    def block_input_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [B] -> [B, gamma] = [anchor, MASK x (gamma - 1)]."""
        ids = torch.full((anchors.shape[0], self.config.block_size), self.config.mask_token_id,
                         dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        return ids

    def forward_block(self, caches: list[KVCache], anchors: torch.Tensor, anchor_positions: torch.Tensor):
        """anchors, anchor_positions [B] long -> h [B, gamma, H] (after the final norm)."""
        gamma = self.config.block_size
        b = anchors.shape[0]
        positions = anchor_positions[:, None] + torch.arange(gamma, device=self._device)  # [B, gamma]
        x = self.embed_tokens(self.block_input_ids(anchors))  # [B, gamma, H]
        cos, sin = self._cos_sin(positions)
        like = x.new_empty(self.config.num_key_value_heads, 0, self.config.head_dim)
        mask = None
        for li, layer in enumerate(self.layers):
            # [B, kv, L_max + gamma, d] with the last gamma rows free for the block's own keys/values
            keys, values, valid = pad_caches(caches, li, like, room=gamma)
            if valid is not None and mask is None:
                block = torch.ones(b, gamma, dtype=torch.bool, device=self._device)
                mask = torch.cat((valid, block), dim=1)[:, None, None, :]  # [B, 1, 1, L_max + gamma]
            x, _, _ = layer.forward_joined(x, cos, sin, lambda k, v: _fill_room(keys, values, k, v), mask)
        return self.norm(x)

    # ---- training-time forward ------------------------------------------------------------------

    def dense_block_mask(self, anchors: torch.Tensor, seq_len: int) -> torch.Tensor:
        """anchors [B, A] -> mask [B, 1, A * gamma, seq_len + A * gamma] (True = attend).

        Block slot of anchor a sees context positions < a and every slot of its own block.
        """
        gamma = self.config.block_size
        b, a = anchors.shape
        query_anchor = anchors.repeat_interleave(gamma, dim=1)  # [B, A * gamma]
        ctx = torch.arange(seq_len, device=anchors.device)[None, None, :] < query_anchor[:, :, None]
        block_id = torch.arange(a, device=anchors.device).repeat_interleave(gamma)  # [A * gamma]
        own = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)  # [B, A * gamma, A * gamma]
        return torch.cat((ctx, own), dim=2)[:, None]

    def forward_blocks_dense(self, features: torch.Tensor, anchor_tokens: torch.Tensor, anchors: torch.Tensor):
        """Teacher-forced backbone for many anchors at once (training).

        features [B, S, L * H] (target features of positions 0..S-1); anchor_tokens, anchors [B, A]
        (token at / position of each anchor) -> h [B, A, gamma, H].
        """
        gamma = self.config.block_size
        b, s, _ = features.shape
        a = anchors.shape[1]
        ctx = self.project_context(features)  # [B, S, H]
        cos_c, sin_c = self._cos_sin(torch.arange(s, device=self._device).expand(b, s))
        positions = (anchors[:, :, None] + torch.arange(gamma, device=self._device)).reshape(b, a * gamma)
        cos_b, sin_b = self._cos_sin(positions)
        x = self.embed_tokens(self.block_input_ids(anchor_tokens.reshape(-1)).reshape(b, a * gamma))
        mask = self.dense_block_mask(anchors, s)
        for layer in self.layers:
            past_k, past_v = layer.self_attn.key_value(ctx, cos_c, sin_c)  # [B, kv, S, d]
            x, _, _ = layer(x, cos_b, sin_b, past_k, past_v, mask)
        return self.norm(x).reshape(b, a, gamma, -1)
