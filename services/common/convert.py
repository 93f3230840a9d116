"""Proto <-> domain conversions shared by the servicers and the remote clients.

The one place protos and dspark_core types meet, one function per direction: sampling parameters,
context features ([n, L*H] in dspark_core, [n, L, H] on the wire), draft supports (SparseDistribution
rows <-> [n, k] support tensors), draft blocks (VerifyItem <-> DraftBlock), proposals (proto Proposal <->
drafter Proposal), ProposeItem, Prefill / Verify results -> StepResult (and back), GetInfo -> TargetInfo,
drafter kinds and finish reasons. Every malformed value raises dspark_core.errors.InvalidArgument naming
the proto field. Knows nothing about servers or Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dspark_core.drafters.base import DraftProcessing, Proposal, ProposeItem
from dspark_core.errors import InvalidArgument
from dspark_core.sampling import SamplingParams, TokenHistory, TokenLogprob
from dspark_core.verification import DraftBlock
from dspark_core.verifier import PrefillItem, StepResult, VerifyItem
from services.common.limits import check_sampling
from dspark_protos.dspark.v1 import types_pb2
from dspark_protos.tensors import tensor_from_proto, tensor_to_proto

DEFAULT_MAX_NEW_TOKENS = 128

DRAFTER_KINDS = {"dspark": types_pb2.DRAFTER_KIND_DSPARK, "dflash": types_pb2.DRAFTER_KIND_DFLASH,
                 "eagle3": types_pb2.DRAFTER_KIND_EAGLE3}

FINISH_REASONS = {
    "stop": types_pb2.FINISH_REASON_STOP,
    "length": types_pb2.FINISH_REASON_LENGTH,
    "context_length": types_pb2.FINISH_REASON_CONTEXT_LENGTH,
}


def params_from_proto(msg: types_pb2.SamplingParams, extra_stop_ids=(), default_max_new_tokens: int =
                      DEFAULT_MAX_NEW_TOKENS, field: str = "sampling") -> SamplingParams:
    """proto SamplingParams (unset = greedy, 0 = default) -> dspark_core SamplingParams (validated).

    `extra_stop_ids` (the model's end-of-sequence ids) join the stop set unless `msg.ignore_eos`."""
    stop = list(msg.stop_token_ids)
    for t in () if msg.ignore_eos else extra_stop_ids:
        if t not in stop:
            stop.append(int(t))
    try:
        return SamplingParams(
            temperature=float(msg.temperature), top_k=int(msg.top_k),
            top_p=float(msg.top_p) if msg.top_p != 0 else 1.0,
            seed=int(msg.seed) if msg.HasField("seed") else None,
            max_new_tokens=int(msg.max_new_tokens) or default_max_new_tokens, stop_token_ids=tuple(stop),
            min_p=float(msg.min_p), presence_penalty=float(msg.presence_penalty),
            frequency_penalty=float(msg.frequency_penalty),
            repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty != 0 else 1.0,
            min_tokens=int(msg.min_tokens), logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}.{exc.field}", exc.value, exc.requirement) from None


def params_to_proto(p: SamplingParams, out: types_pb2.SamplingParams | None = None,
                    complete_stop_set: bool = False) -> types_pb2.SamplingParams:
    """`complete_stop_set`: p.stop_token_ids already holds every stop id (the scheduler resolved the
    model's end-of-sequence ids, or left them out for ignore_eos): the receiver must not add them again."""
    msg = types_pb2.SamplingParams() if out is None else out
    msg.temperature, msg.top_k, msg.top_p = p.temperature, p.top_k, p.top_p
    msg.max_new_tokens = p.max_new_tokens
    del msg.stop_token_ids[:]
    msg.stop_token_ids.extend(p.stop_token_ids)
    if p.seed is not None:
        msg.seed = p.seed % 2**64
    msg.min_p, msg.presence_penalty, msg.frequency_penalty = p.min_p, p.presence_penalty, p.frequency_penalty
    msg.repetition_penalty, msg.min_tokens = p.repetition_penalty, p.min_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    else:
        msg.ClearField("logprobs")
    msg.ignore_eos = complete_stop_set
    return msg


def params_to_dict(p: SamplingParams) -> dict:
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "seed": p.seed,
            "max_new_tokens": p.max_new_tokens, "stop_token_ids": list(p.stop_token_ids), "min_p": p.min_p,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "min_tokens": p.min_tokens, "logprobs": p.logprobs}


def logprobs_to_proto(logprobs, out) -> None:
    """TokenLogprobs -> a repeated TokenLogprob field (nothing for None)."""
    for lp in logprobs or ():
        m = out.add(token_id=lp.token, logprob=lp.logprob)
        for tok, value in lp.top:
            m.top.add(token_id=tok, logprob=value)


def logprobs_from_proto(field, wanted: bool, count: int, name: str) -> list[TokenLogprob] | None:
    """A repeated TokenLogprob field -> TokenLogprobs; None when the request did not ask for them."""
    if not wanted:
        return None
    if len(field) != count:
        raise InvalidArgument(name, f"{len(field)} entries", f"must hold one per committed token ({count})")
    return [TokenLogprob(int(m.token_id), float(m.logprob), tuple((int(t.token_id), float(t.logprob)) for t in m.top))
            for m in field]


def features_to_proto(features: torch.Tensor, start: int, num_layers: int,
                      out: types_pb2.ContextFeatures) -> None:
    """[n, L*H] tapped features -> ContextFeatures [n, L, H] (raw bytes, dtype kept)."""
    n, width = features.shape
    hidden = width // num_layers if num_layers else 0
    out.start_position = start
    tensor_to_proto(features.reshape(n, num_layers, hidden), out.hidden_states)


def features_from_proto(msg: types_pb2.ContextFeatures, field: str, num_layers: int | None = None,
                        hidden: int | None = None) -> torch.Tensor:
    """ContextFeatures -> [n, L*H] tensor; shape checked against the expected layout when given."""
    if not msg.HasField("hidden_states"):
        return torch.zeros((0, (num_layers or 0) * (hidden or 0)))
    try:
        t = tensor_from_proto(msg.hidden_states)
    except ValueError as exc:
        raise InvalidArgument(f"{field}.hidden_states", str(exc), "must be a well-formed Tensor") from None
    if t.dim() != 3 or (num_layers is not None and t.shape[1] != num_layers) or (
            hidden is not None and t.shape[2] != hidden and t.shape[0] > 0):
        raise InvalidArgument(f"{field}.hidden_states.shape", list(t.shape),
                              f"must be [num_positions, {num_layers}, {hidden}]")
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2])  # explicit: a round that committed nothing has 0 rows


def supports_to_proto(support_ids: torch.Tensor, support_probs: torch.Tensor, out) -> None:
    """[n, k] support ids / probs -> n SparseDistribution rows appended to `out` (a repeated field).

    Each row's wire bytes are built with numpy (packed varint ids, raw little-endian float32 probs) and
    parsed by protobuf in C: no Python object per support entry (a 7 x 4,096 support per request and step
    otherwise costs milliseconds, issue 21). Negative ids (not token ids; refused downstream) take the
    plain path."""
    ids = support_ids.detach().to("cpu", torch.int64).numpy()
    probs = support_probs.detach().to("cpu", torch.float32).contiguous().numpy()
    if ids.size and ids.min() < 0:
        for row_ids, row_probs in zip(ids.tolist(), probs.tolist()):
            d = out.add()
            d.token_ids.extend(row_ids)
            d.probs.extend(row_probs)
        return
    for row_ids, row_probs in zip(ids, probs):
        packed = _varints(row_ids)
        raw = row_probs.astype("<f4").tobytes()
        out.add().ParseFromString(b"\x0a" + _varint(len(packed)) + packed + b"\x12" + _varint(len(raw)) + raw
                                  if len(row_ids) else b"")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varints(values: np.ndarray) -> bytes:
    """Non-negative integers (< 2**35) -> their concatenated protobuf varints."""
    v = values.astype(np.int64)
    if not v.size:
        return b""
    top = int(v.max())
    if top < 0x80:  # every id one byte
        return v.astype(np.uint8).tobytes()
    size = np.ones(v.shape[0], dtype=np.int64)
    width = 1
    for bits in (7, 14, 21, 28):
        if top >= 1 << bits:
            size += v >= (1 << bits)
            width += 1
    grid = np.empty((v.shape[0], width), dtype=np.uint8)
    for j in range(width):
        grid[:, j] = ((v >> (7 * j)) & 0x7F) | ((size > j + 1) << 7)
    return grid[np.arange(width)[None, :] < size[:, None]].tobytes()


def _unvarints(buf: bytes) -> np.ndarray:
    """Concatenated protobuf varints -> int32 values (two's complement, as protobuf reads an int32)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    if not a.size:
        return np.zeros(0, np.int32)
    last = a < 0x80
    if last.all():  # every value one byte
        return a.astype(np.int32)
    ends = np.flatnonzero(last)
    if ends.size == 0 or ends[-1] != a.size - 1:
        raise ValueError("truncated varint")
    starts = np.concatenate(([0], ends[:-1] + 1))
    group = np.zeros(a.size, dtype=np.int64)
    group[starts[1:]] = 1
    pos = np.arange(a.size) - starts[np.cumsum(group)]
    if pos.max() > 9:
        raise ValueError("varint too long")
    payload = (a.astype(np.uint64) & np.uint64(0x7F)) << (7 * pos).astype(np.uint64)
    return np.bitwise_or.reduceat(payload, starts).astype(np.int64).astype(np.int32)


def _support_row(s) -> tuple[np.ndarray, np.ndarray]:
    """One SparseDistribution -> (ids int32, probs float32) from its wire bytes (packed, as this process's
    protobuf writes them; any other layout takes the plain path)."""
    b = s.SerializeToString()
    ids = probs = None
    i = 0
    try:
        while i < len(b):
            tag = b[i]
            i += 1
            n, shift = 0, 0
            while True:
                byte = b[i]
                i += 1
                n |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
            if tag == 0x0A and ids is None:
                ids = _unvarints(b[i:i + n])
            elif tag == 0x12 and probs is None:
                probs = np.frombuffer(b[i:i + n], dtype="<f4")
            else:
                raise ValueError("unexpected field")
            i += n
    except (ValueError, IndexError):
        return np.asarray(list(s.token_ids), dtype=np.int32), np.asarray(list(s.probs), dtype=np.float32)
    return (np.zeros(0, np.int32) if ids is None else ids), (np.zeros(0, np.float32) if probs is None else probs)


def supports_from_proto(supports, num_tokens: int, field: str) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseDistribution rows (one per draft token) -> [n, k] ids / probs; ragged rows are padded with
    zero-probability copies of their first id."""
    if len(supports) != num_tokens:
        raise InvalidArgument(f"{field}.draft_supports", f"{len(supports)} supports",
                              f"must hold one support per draft token ({num_tokens})")
    rows = [_support_row(s) for s in supports]
    k = max(len(r_ids) for r_ids, _ in rows)
    ids = np.zeros((num_tokens, k), dtype=np.int64)
    probs = np.zeros((num_tokens, k), dtype=np.float32)
    for i, (r_ids, r_probs) in enumerate(rows):
        if len(r_ids) != len(r_probs) or not len(r_ids):
            raise InvalidArgument(f"{field}.draft_supports[{i}]", f"{len(r_ids)} ids, {len(r_probs)} probs",
                                  "must hold as many probs as token_ids, at least one")
        ids[i, : len(r_ids)] = r_ids
        ids[i, len(r_ids):] = r_ids[0]
        probs[i, : len(r_probs)] = r_probs
    return torch.from_numpy(ids), torch.from_numpy(probs)


def block_to_proto(block: DraftBlock, item) -> None:
    """DraftBlock -> VerifyItem.draft_token_ids / draft_supports."""
    item.draft_token_ids.extend(block.tokens)
    if block.support_ids is not None:
        supports_to_proto(block.support_ids, block.support_probs, item.draft_supports)


def block_from_proto(item, field: str) -> DraftBlock:
    """VerifyItem drafts -> DraftBlock (supports validated, see supports_from_proto)."""
    tokens = tuple(item.draft_token_ids)
    if not item.draft_supports:
        return DraftBlock(tokens=tokens)
    ids, probs = supports_from_proto(item.draft_supports, len(tokens), field)
    return DraftBlock(tokens=tokens, support_ids=ids, support_probs=probs)


def verify_item_to_proto(item: VerifyItem, out: types_pb2.VerifyItem) -> None:
    """The engine's VerifyItem -> proto VerifyItem (the verifier holds the request's sampling state)."""
    out.request_id, out.anchor_token_id, out.anchor_position = item.request_id, item.anchor, item.anchor_pos
    block_to_proto(item.draft, out)


def verify_item_from_proto(msg: types_pb2.VerifyItem, field: str) -> VerifyItem:
    if not msg.request_id:
        raise InvalidArgument(f"{field}.request_id", msg.request_id, "must not be empty")
    return VerifyItem(msg.request_id, int(msg.anchor_token_id), int(msg.anchor_position), block_from_proto(msg, field))


def prefill_item_to_proto(item: PrefillItem) -> types_pb2.PrefillRequest:
    msg = types_pb2.PrefillRequest(request_id=item.request_id, prompt_token_ids=list(item.prompt_ids),
                                   generated_prompt_tokens=int(item.generated_in_prompt))
    params_to_proto(item.params, msg.sampling, complete_stop_set=True)  # the scheduler resolved the stop set
    if item.feature_rows is not None:
        msg.context_feature_rows = int(item.feature_rows)
    return msg


def prefill_item_from_proto(msg: types_pb2.PrefillRequest, extra_stop_ids=()) -> PrefillItem:
    """PrefillRequest -> PrefillItem; `extra_stop_ids` (the target's EOS ids) join the request's stop ids."""
    if not msg.request_id:
        raise InvalidArgument("request_id", msg.request_id, "must not be empty")
    if msg.generated_prompt_tokens and msg.generated_prompt_tokens >= len(msg.prompt_token_ids):
        raise InvalidArgument("generated_prompt_tokens", msg.generated_prompt_tokens,
                              f"must be below the prompt's length ({len(msg.prompt_token_ids)})")
    return PrefillItem(msg.request_id, tuple(msg.prompt_token_ids), params_from_proto(msg.sampling, extra_stop_ids),
                       int(msg.generated_prompt_tokens),
                       int(msg.context_feature_rows) if msg.HasField("context_feature_rows") else None)


def proposal_to_proto(prop: Proposal, max_tokens: int, out: types_pb2.Proposal) -> None:
    """A drafter's Proposal, cut to its first `max_tokens` drafts -> proto Proposal's drafts, supports and
    confidences (without a confidence head: each draft token's own draft probability)."""
    n = min(len(prop.tokens), max_tokens)
    out.draft_token_ids.extend(int(t) for t in prop.tokens[:n])
    if prop.support_ids is not None:
        supports_to_proto(prop.support_ids[:n], prop.support_probs[:n], out.draft_supports)
    if prop.confidences is not None:
        out.confidences.extend(prop.confidences[:n].tolist())
    elif prop.support_ids is not None and n:  # each draft token's own draft probability
        ids, probs = prop.support_ids[:n].to("cpu"), prop.support_probs[:n].to("cpu", torch.float32)
        tokens = torch.tensor([int(t) for t in prop.tokens[:n]], dtype=ids.dtype)[:, None]
        out.confidences.extend(((ids == tokens) * probs).sum(-1).tolist())
    else:
        out.confidences.extend([1.0] * n)
    out.processed = bool(prop.processed)


def proposal_from_proto(p: types_pb2.Proposal, field: str = "proposal") -> Proposal:
    """proto Proposal (status OK) -> a drafter Proposal, as the engine receives it from a local drafter."""
    n = len(p.draft_token_ids)
    ids = probs = None
    if p.draft_supports and n > 0:
        ids, probs = supports_from_proto(p.draft_supports, n, field)
    conf = torch.tensor(list(p.confidences), dtype=torch.float32) if len(p.confidences) == n else None
    return Proposal(tokens=list(p.draft_token_ids), support_ids=ids, support_probs=probs, confidences=conf,
                    processed=bool(p.processed))


def kind_to_proto(kind: str) -> int:
    """A drafter's kind ("dspark", "dflash", "eagle3") -> DrafterKind (UNSPECIFIED for any other)."""
    return DRAFTER_KINDS.get(kind, types_pb2.DRAFTER_KIND_UNSPECIFIED)


def kind_from_proto(kind: int) -> str:
    return next((name for name, value in DRAFTER_KINDS.items() if value == kind), "unknown")


@dataclass
class TargetInfo:
    """The engine's target seam (tap_layer_ids, max_context, vocab_size), from a verifier's GetInfo."""

    name: str
    vocab_size: int
    max_context: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    tap_layer_ids: tuple[int, ...]
    sps_points: list
    tokenizer: object = None
    # {requests: points} of the cost table's request rows (empty: the verifier published none)
    sps_rows: dict = field(default_factory=dict)


def target_info_from_proto(info: types_pb2.VerifierServiceGetInfoResponse) -> TargetInfo:
    return TargetInfo(info.model_name, info.vocab_size, info.max_context_length, info.hidden_size,
                      tuple(info.eos_token_ids), tuple(info.tap_layer_ids),
                      [(p.num_tokens, p.steps_per_second) for p in info.sps_table.points],
                      sps_rows={str(r.num_requests): [(p.num_tokens, p.steps_per_second) for p in r.points]
                                for r in info.sps_table.rows})


def verify_result_to_proto(res: StepResult, num_layers: int, out: types_pb2.VerifyResult) -> None:
    """A Verifier's StepResult -> an OK VerifyResult (committed tokens, stop, the committed features)."""
    out.status = types_pb2.ITEM_STATUS_OK
    out.num_accepted = res.num_accepted
    out.committed_token_ids.extend(res.tokens)
    logprobs_to_proto(res.logprobs, out.logprobs)
    out.stopped = res.stopped
    if res.stopped:
        out.finish_reason = types_pb2.FINISH_REASON_STOP
    features_to_proto(res.features, res.features_start, num_layers, out.context_features)


def prefill_result_from_proto(resp: types_pb2.PrefillResponse, item: PrefillItem) -> StepResult:
    """A PrefillResponse for `item` -> the StepResult a local Verifier's prefill would have returned."""
    feats = features_from_proto(resp.context_features, "context_features")
    start = int(resp.context_features.start_position)
    n = len(item.prompt_ids)
    if start + feats.shape[0] != n or (item.feature_rows is None and start) or \
            (item.feature_rows is not None and feats.shape[0] > item.feature_rows):
        raise InvalidArgument("context_features", [start, feats.shape[0]],
                              f"must be the last rows of the {n}-token prompt it asked for (rows "
                              f"{'all' if item.feature_rows is None else item.feature_rows})")
    return StepResult(item.request_id, [resp.anchor_token_id], 0, resp.stopped, feats, start,
                      list(item.prompt_ids[start:]),
                      logprobs_from_proto(resp.logprobs, item.params.logprobs is not None, 1, "logprobs"))


def verify_result_from_proto(r: types_pb2.VerifyResult, item: VerifyItem) -> StepResult:
    """An OK VerifyResult for `item` -> the StepResult a local Verifier would have returned."""
    a = r.num_accepted
    # the verifier holds the request's parameters: logprobs come back when it asked for them (the engine
    # checks there is one per committed token)
    return StepResult(item.request_id, list(r.committed_token_ids), a, r.stopped,
                      features_from_proto(r.context_features, "context_features"), item.anchor_pos,
                      [item.anchor, *item.draft.tokens[:a]],
                      logprobs_from_proto(r.logprobs, len(r.logprobs) > 0, len(r.committed_token_ids), "logprobs"))


def propose_item_to_proto(request_id: str, it: ProposeItem, features: torch.Tensor, start: int, tokens,
                          num_layers: int, seed: int | None, begins: bool = False) -> types_pb2.ProposeItem:
    """One request's drafting input -> ProposeItem; `features` / `start` / `tokens` are the context to
    send (the new positions, or all of them on a resend). Tokens go along when there is one per row.
    `begins`: the request's drafter context begins at `start` (ProposeItem.begins_context)."""
    msg = types_pb2.ProposeItem(request_id=request_id, anchor_token_id=int(it.anchor),
                                anchor_position=int(it.anchor_pos), temperature=float(it.temperature),
                                begins_context=begins)
    features_to_proto(features, start, num_layers, msg.context_features)
    if len(tokens) == features.shape[0]:  # the tokens at the feature rows (EAGLE-3 conditions on them)
        msg.context_token_ids.extend(int(t) for t in tokens)
    if seed is not None:
        msg.seed = seed
    if getattr(it, "coupling_seed", None) is not None:
        msg.coupling_seed = int(it.coupling_seed)
    proc = getattr(it, "processing", None)
    if proc is not None:  # the stop set is complete: the engine resolved end-of-sequence ids already
        params_to_proto(proc.params, msg.processing.params, complete_stop_set=True)
        msg.processing.prompt_token_ids.extend(int(t) for t in proc.history.prompt_ids)
        msg.processing.output_token_ids.extend(int(t) for t in proc.history.output_ids)
    return msg


def draft_processing_from_proto(msg: types_pb2.DraftProcessing, vocab_size: int, anchor_pos: int,
                                field: str = "processing") -> DraftProcessing | None:
    """A ProposeItem's processing -> DraftProcessing (None when it asks for nothing), every value checked:
    the parameters as the verifier checks them, token ids in [0, vocab_size), and the history exactly the
    anchor_pos + 1 tokens up to and including the anchor."""
    params = check_sampling(params_from_proto(msg.params, field=f"{field}.params"), vocab_size,
                            {k: f"{field}.params.{k}" for k in ("stop_token_ids", "temperature", "top_p", "top_k",
                                                                "max_new_tokens")})
    for name in ("prompt_token_ids", "output_token_ids"):
        ids = getattr(msg, name)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"{field}.{name}", bad[:5], f"must be token ids in [0, {vocab_size})")
    n = len(msg.prompt_token_ids) + len(msg.output_token_ids)
    if n != anchor_pos + 1:
        raise InvalidArgument(f"{field}.output_token_ids", f"{n} tokens with the prompt",
                              f"must be the anchor_position + 1 = {anchor_pos + 1} tokens up to the anchor")
    if not params.processed:
        return None
    return DraftProcessing(params, TokenHistory(tuple(msg.prompt_token_ids), tuple(msg.output_token_ids)))
