"""Proto <-> domain conversions shared by the servicers and the remote clients.

The one place protos and dspark_core types meet, one function per direction: sampling parameters,
context features ([n, L*H] in dspark_core, [n, L, H] on the wire), draft supports (SparseDistribution
rows <-> [n, k] support tensors), draft blocks (VerifyItem <-> DraftBlock), proposals (proto Proposal <->
drafter Proposal), ProposeItem, Prefill / Verify results -> StepResult (and back), GetInfo -> TargetInfo,
drafter kinds and finish reasons. Every malformed value raises dspark_core.errors.InvalidArgument naming
the proto field. Knows nothing about servers or Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_core.drafters.base import Proposal, ProposeItem
from dspark_core.errors import InvalidArgument
from dspark_core.sampling import SamplingParams, TokenLogprob
from dspark_core.verification import DraftBlock
from dspark_core.verifier import PrefillItem, StepResult, VerifyItem
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
    """[n, k] support ids / probs -> n SparseDistribution rows appended to `out` (a repeated field)."""
    for ids, probs in zip(support_ids.tolist(), support_probs.float().tolist()):
        d = out.add()
        d.token_ids.extend(ids)
        d.probs.extend(probs)


def supports_from_proto(supports, num_tokens: int, field: str) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseDistribution rows (one per draft token) -> [n, k] ids / probs; ragged rows are padded with
    zero-probability copies of their first id."""
    if len(supports) != num_tokens:
        raise InvalidArgument(f"{field}.draft_supports", f"{len(supports)} supports",
                              f"must hold one support per draft token ({num_tokens})")
    k = max(len(s.token_ids) for s in supports)
    ids = torch.zeros((num_tokens, k), dtype=torch.long)
    probs = torch.zeros((num_tokens, k), dtype=torch.float32)
    for i, s in enumerate(supports):
        if len(s.token_ids) != len(s.probs) or not s.token_ids:
            raise InvalidArgument(f"{field}.draft_supports[{i}]", f"{len(s.token_ids)} ids, {len(s.probs)} probs",
                                  "must hold as many probs as token_ids, at least one")
        ids[i, : len(s.token_ids)] = torch.tensor(list(s.token_ids))
        ids[i, len(s.token_ids):] = s.token_ids[0]
        probs[i, : len(s.probs)] = torch.tensor(list(s.probs))
    return ids, probs


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
    msg = types_pb2.PrefillRequest(request_id=item.request_id, prompt_token_ids=list(item.prompt_ids))
    params_to_proto(item.params, msg.sampling, complete_stop_set=True)  # the scheduler resolved the stop set
    return msg


def prefill_item_from_proto(msg: types_pb2.PrefillRequest, extra_stop_ids=()) -> PrefillItem:
    """PrefillRequest -> PrefillItem; `extra_stop_ids` (the target's EOS ids) join the request's stop ids."""
    if not msg.request_id:
        raise InvalidArgument("request_id", msg.request_id, "must not be empty")
    return PrefillItem(msg.request_id, tuple(msg.prompt_token_ids), params_from_proto(msg.sampling, extra_stop_ids))


def proposal_to_proto(prop: Proposal, max_tokens: int, out: types_pb2.Proposal) -> None:
    """A drafter's Proposal, cut to its first `max_tokens` drafts -> proto Proposal's drafts, supports and
    confidences (without a confidence head: each draft token's own draft probability)."""
    n = min(len(prop.tokens), max_tokens)
    out.draft_token_ids.extend(int(t) for t in prop.tokens[:n])
    draft_probs = [1.0] * n
    if prop.support_ids is not None:
        supports_to_proto(prop.support_ids[:n], prop.support_probs[:n], out.draft_supports)
        for r, d in enumerate(out.draft_supports):
            draft_probs[r] = sum(q for t, q in zip(d.token_ids, d.probs) if t == prop.tokens[r])
    out.confidences.extend(prop.confidences[:n].tolist() if prop.confidences is not None else draft_probs)


def proposal_from_proto(p: types_pb2.Proposal, field: str = "proposal") -> Proposal:
    """proto Proposal (status OK) -> a drafter Proposal, as the engine receives it from a local drafter."""
    n = len(p.draft_token_ids)
    ids = probs = None
    if p.draft_supports and n > 0:
        ids, probs = supports_from_proto(p.draft_supports, n, field)
    conf = torch.tensor(list(p.confidences), dtype=torch.float32) if len(p.confidences) == n else None
    return Proposal(tokens=list(p.draft_token_ids), support_ids=ids, support_probs=probs, confidences=conf)


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


def target_info_from_proto(info: types_pb2.VerifierServiceGetInfoResponse) -> TargetInfo:
    return TargetInfo(info.model_name, info.vocab_size, info.max_context_length, info.hidden_size,
                      tuple(info.eos_token_ids), tuple(info.tap_layer_ids),
                      [(p.num_tokens, p.steps_per_second) for p in info.sps_table.points])


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
    return StepResult(item.request_id, [resp.anchor_token_id], 0, resp.stopped,
                      features_from_proto(resp.context_features, "context_features"), 0, list(item.prompt_ids),
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
                          num_layers: int, seed: int | None) -> types_pb2.ProposeItem:
    """One request's drafting input -> ProposeItem; `features` / `start` / `tokens` are the context to
    send (the new positions, or all of them on a resend). Tokens go along when there is one per row."""
    msg = types_pb2.ProposeItem(request_id=request_id, anchor_token_id=int(it.anchor),
                                anchor_position=int(it.anchor_pos), temperature=float(it.temperature))
    features_to_proto(features, start, num_layers, msg.context_features)
    if len(tokens) == features.shape[0]:  # the tokens at the feature rows (EAGLE-3 conditions on them)
        msg.context_token_ids.extend(int(t) for t in tokens)
    if seed is not None:
        msg.seed = seed
    return msg
