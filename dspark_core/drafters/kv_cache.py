"""Per-request draft KV cache and its batched, padded view.

`KVCache` holds, for one request, every draft layer's keys/values of committed positions 0..length-1
(already normed and rotated), in buffers that grow geometrically so appending a round's few rows is
amortised O(rows). `pad_caches` stacks several requests' caches into one right-padded batch plus the
boolean validity mask that attention needs for ragged lengths.

Knows nothing about what the rows mean (DFlash context K/V or Eagle3 token K/V).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.length = 0
        # per layer: [kv_heads, capacity, d]
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers

    def _ensure(self, layer: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers of `layer` with room for n rows past `length` (`like` [kv_heads, *, d] for a first one)."""
        buf_k, buf_v = self._keys[layer], self._values[layer]
        if buf_k is None or buf_k.shape[1] < self.length + n:
            cap = max(2 * (0 if buf_k is None else buf_k.shape[1]), self.length + n, 16)
            new_k = like.new_empty(like.shape[0], cap, like.shape[2])
            new_v = like.new_empty(like.shape[0], cap, like.shape[2])
            if buf_k is not None:
                new_k[:, : self.length] = buf_k[:, : self.length]
                new_v[:, : self.length] = buf_v[:, : self.length]
            buf_k, buf_v = self._keys[layer], self._values[layer] = new_k, new_v
        return buf_k, buf_v

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [kv_heads, n, d]; call once per layer, then `commit(n)`."""
        n = k.shape[1]
        buf_k, buf_v = self._ensure(layer, n, k)
        buf_k[:, self.length : self.length + n] = k
        buf_v[:, self.length : self.length + n] = v

    def with_room(self, layer: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [kv_heads, length + n, d] views: the committed rows, then n scratch rows the caller may fill
        (they are not committed, so the next append overwrites them)."""
        buf_k, buf_v = self._ensure(layer, n, like)
        return buf_k[:, : self.length + n], buf_v[:, : self.length + n]

    def commit(self, n: int) -> None:
        self.length += n

    def crop(self, length: int) -> None:
        """Forget every row at or after `length`."""
        assert 0 <= length <= self.length
        self.length = length

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [kv_heads, length, d] (views)."""
        return self._keys[layer][:, : self.length], self._values[layer][:, : self.length]


def pad_caches(caches: list[KVCache], layer: int, like: torch.Tensor, room: int = 0):
    """Right-padded k, v [B, kv_heads, L_max + room, d] and valid [B, L_max] bool (None if no padding needed).

    `like` ([kv_heads, *, d]) supplies dtype/device/head shape for caches that are still empty. The last
    `room` rows are left for the caller to fill (a block's own keys/values), which saves concatenating the
    whole context to them; with one request they live in the cache's spare capacity (no copy at all).
    """
    lengths = [c.length for c in caches]
    l_max = max(lengths)
    if len(caches) == 1 and l_max:
        if room:
            k, v = caches[0].with_room(layer, room, like)
        else:
            k, v = caches[0].layer(layer)
        return k.unsqueeze(0), v.unsqueeze(0), None
    b, (kvh, _, d) = len(caches), like.shape
    keys = like.new_zeros(b, kvh, l_max + room, d)
    values = like.new_zeros(b, kvh, l_max + room, d)
    for i, c in enumerate(caches):
        if c.length:
            k, v = c.layer(layer)
            keys[i, :, : c.length] = k
            values[i, :, : c.length] = v
    if min(lengths) == l_max:
        return keys, values, None
    valid = torch.arange(l_max, device=like.device)[None, :] < torch.tensor(lengths, device=like.device)[:, None]
    return keys, values, valid
