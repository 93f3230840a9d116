"""What the wire and the engine can hold: the one place request values are bounded at the edge.

A value that passes here fits every proto field it travels in (float32, uint32, int32, uint64) and means
what the client asked for on every hop, so no request can fail a batched call on someone else's behalf
with a value that only breaks further in. Knows nothing about servers or models.
"""

from __future__ import annotations

import math
import re
import struct

from dspark_core.errors import InvalidArgument
from dspark_core.sampling import SamplingParams

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
# the largest finite float32: a larger temperature would travel as inf
FLOAT32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
MAX_STOP_TOKEN_IDS = 64
# below these the scaled scores (a logit / repetition_penalty / temperature) overflow float32 to inf, and a
# sampled request's distribution is NaN: the request would fail in the engine naming no field of its own
MIN_TEMPERATURE = 1e-6
MIN_REPETITION_PENALTY = 1e-6
# request ids: printable, bounded (they are Redis keys, log fields and map keys on every pod)
MAX_REQUEST_ID_CHARS = 128
# what a scheduler sends its pods: a client's id (choice suffix included, at most MAX_REQUEST_ID_CHARS) behind its
# owner's prefix (services.common.identity.scoped_request_id)
MAX_POD_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS + 32
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]+")


def _float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0] if abs(x) <= FLOAT32_MAX else math.inf


# the floors as float32 holds them: a value at a floor reads this after a hop (1e-6 travels as 9.99999997e-07), and
# a value one hop accepts must not be refused by the next
MIN_TEMPERATURE_F32 = _float32(MIN_TEMPERATURE)
MIN_REPETITION_PENALTY_F32 = _float32(MIN_REPETITION_PENALTY)


def check_request_id(rid: str, field: str = "request_id", limit: int = MAX_REQUEST_ID_CHARS) -> str:
    if len(rid) > limit:
        raise InvalidArgument(field, rid[:40] + "...", f"must be at most {limit} characters")
    if not _REQUEST_ID.fullmatch(rid):  # not match(): its `$` also matches before a final "\n"
        raise InvalidArgument(field, rid, "must hold only letters, digits and . _ : @ / + = -")
    return rid


# check_sampling's fields as a SamplingParams message inside a request names them
SAMPLING_FIELDS = {k: f"sampling.{k}" for k in ("temperature", "top_p", "top_k", "repetition_penalty",
                                                 "max_new_tokens", "stop_token_ids")}


def check_temperature(t: float, field: str = "temperature") -> float:
    """A sampling temperature the engine can apply: 0 (greedy) or in [MIN_TEMPERATURE, float32 max]."""
    if t > FLOAT32_MAX:
        raise InvalidArgument(field, t, f"must be a finite number in [0, {FLOAT32_MAX:.6g}]")
    if 0 < t < MIN_TEMPERATURE_F32:
        raise InvalidArgument(field, t, f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (a smaller one "
                                        "overflows the scaled logits)")
    return t


def check_sampling(p: SamplingParams, vocab_size: int | None = None, names: dict[str, str] | None = None
                   ) -> SamplingParams:
    """Refuse sampling values that the proto fields or the engine cannot carry; `names` renames fields for
    the client's API (e.g. {"max_new_tokens": "max_tokens"})."""
    names = names or {}

    def bad(field: str, value, requirement: str):
        raise InvalidArgument(names.get(field, field), value, requirement)

    check_temperature(p.temperature, names.get("temperature", "temperature"))
    if p.top_p < 1.0 and _float32(p.top_p) <= 0:
        bad("top_p", p.top_p, "must be in (0, 1] and at least 1e-38 (it travels as a float32)")
    if p.repetition_penalty < MIN_REPETITION_PENALTY_F32:
        bad("repetition_penalty", p.repetition_penalty, f"must be in [{MIN_REPETITION_PENALTY:g}, 10] (a smaller "
                                                        "one overflows the penalized logits)")
    if p.top_k > UINT32_MAX:
        bad("top_k", p.top_k, f"must be an integer in [0, {UINT32_MAX}]")
    if p.max_new_tokens > UINT32_MAX:
        bad("max_new_tokens", p.max_new_tokens, f"must be an integer in [1, {UINT32_MAX}]")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        bad("stop_token_ids", f"{len(p.stop_token_ids)} ids",
            f"must hold at most {MAX_STOP_TOKEN_IDS} ids (the model's end-of-sequence ids count among them "
            "unless ignore_eos)")
    top = vocab_size if vocab_size is not None else INT32_MAX + 1
    out = [t for t in p.stop_token_ids if t >= top]
    if out:
        bad("stop_token_ids", out[:5], f"must be token ids in [0, {top})")
    return p
