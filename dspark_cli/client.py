"""`dspark client generate --address HOST:PORT "PROMPT"`: one request to a running scheduler over gRPC.

Streams text as it arrives, or prints the same JSON fields as `dspark generate --json` plus the request's
speculative metrics (and, with --logprobs K, every token's logprob). A status error
from the server (bad input, overload, unavailable) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from dspark_core.errors import InvalidArgument

from .generate import add_sampling_args, parse_prompt_ids, sampling_params

_FINISH = {1: "stop", 2: "length", 3: "context_length"}


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="talk to a running scheduler", description="gRPC client of SchedulerService.")
    which = p.add_subparsers(dest="action", required=True, parser_class=type(p), metavar="ACTION")
    g = which.add_parser("generate", help="generate a continuation of PROMPT on a scheduler",
                         description="Send one request to a running scheduler (`dspark serve all` or `serve "
                                     "scheduler`) over gRPC and stream the answer; same sampling flags and defaults "
                                     "as `dspark generate`.")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt text (tokenized by the server, no chat template)")
    g.add_argument("--address", default="127.0.0.1:50051",
                   help="scheduler host:port, or several comma-separated: on UNAVAILABLE the request is retried on "
                        "the next one with the same request id, which adopts it from its checkpoint (default 127.0.0.1:50051)")
    g.add_argument("--retry-for", type=float, default=30.0,
                   help="seconds to keep retrying UNAVAILABLE schedulers (default 30)")
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of text")
    g.add_argument("--model", default="", help="model name (default: the server's)")
    g.add_argument("--request-id", default="", help="client-chosen request id")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up (default 600)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"),
                   help="API key of the scheduler (default DSPARK_API_KEY)")
    g.add_argument("--tls-ca", default=os.environ.get("DSPARK_TLS_CA"),
                   help="CA certificate of a scheduler that serves TLS (default DSPARK_TLS_CA; plaintext without)")
    add_sampling_args(g)
    add_processing_args(g)
    g.set_defaults(func=run)


def add_processing_args(p) -> None:
    """The request's own processing (docs/openai_api.md): speculation stays exact with any of them."""
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], per token generated (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2], times the count of each generated token (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0, on tokens of the prompt or the output (default 1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1], relative to the top token (default 0 = off)")
    p.add_argument("--min-tokens", type=int, default=0, help="no stop token before this many tokens (default 0)")
    p.add_argument("--stop-token-ids", default="", help="comma-separated extra stop token ids")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence ids")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's logprob and the K most likely alternatives (0..20)")


def processing_params(args, params):
    """`params` with the processing flags of `add_processing_args` (validated by SamplingParams)."""
    stop = parse_prompt_ids(args.stop_token_ids) if args.stop_token_ids.strip() else []
    return dataclasses.replace(params, presence_penalty=args.presence_penalty,
                               frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                               min_p=args.min_p, min_tokens=args.min_tokens, logprobs=args.logprobs,
                               stop_token_ids=tuple(stop))


def build_request(args):
    from dspark_protos.dspark.v1 import types_pb2

    from services.common.convert import params_to_proto

    if (args.prompt is None) == (args.prompt_ids is None):
        raise InvalidArgument("prompt", args.prompt, "give exactly one of PROMPT or --prompt-ids")
    # validated here: the wire cannot carry e.g. a negative top_k
    params = processing_params(args, sampling_params(args))
    import uuid

    # a client-chosen id, so that a retry on another scheduler continues the same request
    req = types_pb2.GenerateRequest(model=args.model, request_id=args.request_id or f"cli-{uuid.uuid4().hex[:16]}")
    if args.prompt_ids is not None:
        req.prompt_token_ids.token_ids.extend(parse_prompt_ids(args.prompt_ids))
    else:
        req.prompt_text = args.prompt
    params_to_proto(params, req.sampling)
    req.sampling.ignore_eos = args.ignore_eos
    if args.seed is None:
        req.sampling.ClearField("seed")
    return req


def _channel(address: str, tls_ca: str | None):
    import grpc

    from services.common.security import tls_channel_options
    from services.common.server import CHANNEL_OPTIONS

    if not tls_ca:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        ca = open(tls_ca, "rb").read()
    except OSError as exc:
        raise InvalidArgument("tls_ca", tls_ca, f"must be a readable CA certificate ({exc.strerror})") from None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca),
                               options=[*CHANNEL_OPTIONS, *tls_channel_options()])


def run(args) -> int:
    import grpc

    from dspark_protos.dspark.v1 import scheduler_service_pb2_grpc

    req = build_request(args)
    t0 = time.perf_counter()
    tokens, accepted, text, last, logprobs = [], [], [], None, []
    addresses = [a.strip() for a in args.address.split(",") if a.strip()]
    deadline = time.monotonic() + args.retry_for
    attempt = 0
    while last is None or not last.finish_reason:
        address = addresses[attempt % len(addresses)]
        attempt += 1
        seen, stream_text = 0, ""  # an adopted stream replays what this client already has: skip it
        try:
            with _channel(address, args.tls_ca) as ch:
                stub = scheduler_service_pb2_grpc.SchedulerServiceStub(ch)
                md = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
                for chunk in stub.Generate(req, timeout=args.timeout, metadata=md):
                    ids = list(chunk.token_ids)
                    skip = max(0, min(len(ids), len(tokens) - seen))
                    seen += len(ids)
                    tokens.extend(ids[skip:])
                    logprobs.extend(chunk.logprobs[skip:])
                    if chunk.HasField("round") and skip < len(ids):
                        accepted.append(chunk.round.num_accepted)
                    stream_text += chunk.text_delta
                    printed = sum(map(len, text))
                    if len(stream_text) > printed:  # text is a prefix-consistent function of the tokens
                        delta = stream_text[printed:]
                        text.append(delta)
                        if not args.json:
                            sys.stdout.write(delta)
                            sys.stdout.flush()
                    last = chunk
        except grpc.RpcError as exc:
            retryable = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            if retryable and time.monotonic() < deadline:
                time.sleep(min(1.0, 0.2 * attempt))
                continue
            if not args.json and text:
                print()
            print(f"dspark client: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    wall = time.perf_counter() - t0
    full = "".join(text)
    if args.json:
        s = last.summary
        rounds = s.num_rounds
        print(json.dumps({
            "text": full if (full or args.prompt_ids is None) else None,
            "token_ids": tokens,
            "num_rounds": rounds,
            "accepted_per_round": accepted,
            "tau": (sum(accepted) + rounds) / rounds if rounds else None,
            "tokens_per_second": round(len(tokens) / wall, 3),
            "prompt_tokens": s.prompt_tokens,
            "finish_reason": _FINISH.get(last.finish_reason),
            "request_id": last.request_id,
            "speculative": {"num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
                            "accepted_per_position": list(s.accepted_per_position),
                            "mean_verification_length": s.mean_verification_length},
            **({"logprobs": [{"token_id": m.token_id, "logprob": m.logprob,
                              "top": [[t.token_id, t.logprob] for t in m.top]} for m in logprobs]}
               if args.logprobs is not None else {}),
        }))
    elif full:
        print()
    else:
        print(" ".join(map(str, tokens)))
    return 0
