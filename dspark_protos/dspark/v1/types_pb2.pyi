from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]

class ItemStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ITEM_STATUS_UNSPECIFIED: _ClassVar[ItemStatus]
    ITEM_STATUS_OK: _ClassVar[ItemStatus]
    ITEM_STATUS_UNKNOWN_REQUEST: _ClassVar[ItemStatus]
    ITEM_STATUS_POSITION_MISMATCH: _ClassVar[ItemStatus]
    ITEM_STATUS_INVALID_ARGUMENT: _ClassVar[ItemStatus]
    ITEM_STATUS_RESOURCE_EXHAUSTED: _ClassVar[ItemStatus]

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_DSPARK: _ClassVar[DrafterKind]
    DRAFTER_KIND_DFLASH: _ClassVar[DrafterKind]
    DRAFTER_KIND_EAGLE3: _ClassVar[DrafterKind]

class SequentialHead(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEQUENTIAL_HEAD_UNSPECIFIED: _ClassVar[SequentialHead]
    SEQUENTIAL_HEAD_NONE: _ClassVar[SequentialHead]
    SEQUENTIAL_HEAD_MARKOV: _ClassVar[SequentialHead]
    SEQUENTIAL_HEAD_RNN: _ClassVar[SequentialHead]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_INT64: Dtype
DTYPE_INT32: Dtype
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason
ITEM_STATUS_UNSPECIFIED: ItemStatus
ITEM_STATUS_OK: ItemStatus
ITEM_STATUS_UNKNOWN_REQUEST: ItemStatus
ITEM_STATUS_POSITION_MISMATCH: ItemStatus
ITEM_STATUS_INVALID_ARGUMENT: ItemStatus
ITEM_STATUS_RESOURCE_EXHAUSTED: ItemStatus
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_DSPARK: DrafterKind
DRAFTER_KIND_DFLASH: DrafterKind
DRAFTER_KIND_EAGLE3: DrafterKind
SEQUENTIAL_HEAD_UNSPECIFIED: SequentialHead
SEQUENTIAL_HEAD_NONE: SequentialHead
SEQUENTIAL_HEAD_MARKOV: SequentialHead
SEQUENTIAL_HEAD_RNN: SequentialHead

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop_token_ids", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logprobs: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class ContextFeatures(_message.Message):
    __slots__ = ("start_position", "hidden_states")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    hidden_states: Tensor
    def __init__(self, start_position: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("num_requests", "num_tokens", "forward_seconds", "queue_seconds")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    num_tokens: int
    forward_seconds: float
    queue_seconds: float
    def __init__(self, num_requests: _Optional[int] = ..., num_tokens: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_text", "prompt_token_ids", "model", "sampling", "drafter", "policy", "request_id", "n")
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    prompt_text: str
    prompt_token_ids: TokenIds
    model: str
    sampling: SamplingParams
    drafter: str
    policy: str
    request_id: str
    n: int
    def __init__(self, prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., model: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., drafter: _Optional[str] = ..., policy: _Optional[str] = ..., request_id: _Optional[str] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text_delta", "round", "finish_reason", "summary", "logprobs", "choice_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    round: RoundStats
    finish_reason: FinishReason
    summary: GenerationSummary
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    choice_index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., round: _Optional[_Union[RoundStats, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., summary: _Optional[_Union[GenerationSummary, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., choice_index: _Optional[int] = ...) -> None: ...

class GenerateUnaryRequest(_message.Message):
    __slots__ = ("prompt_text", "prompt_token_ids", "model", "sampling", "drafter", "policy", "request_id", "n")
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    prompt_text: str
    prompt_token_ids: TokenIds
    model: str
    sampling: SamplingParams
    drafter: str
    policy: str
    request_id: str
    n: int
    def __init__(self, prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., model: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., drafter: _Optional[str] = ..., policy: _Optional[str] = ..., request_id: _Optional[str] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateUnaryResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "summary", "logprobs", "choices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    summary: GenerationSummary
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    choices: _containers.RepeatedCompositeFieldContainer[GenerateChoice]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., summary: _Optional[_Union[GenerationSummary, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., choices: _Optional[_Iterable[_Union[GenerateChoice, _Mapping]]] = ...) -> None: ...

class GenerateChoice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "summary", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    summary: GenerationSummary
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., summary: _Optional[_Union[GenerationSummary, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("round_index", "num_drafted", "num_verified", "num_accepted", "num_committed", "verify_batch_tokens", "draft_seconds", "verify_seconds")
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    round_index: int
    num_drafted: int
    num_verified: int
    num_accepted: int
    num_committed: int
    verify_batch_tokens: int
    draft_seconds: float
    verify_seconds: float
    def __init__(self, round_index: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_verified: _Optional[int] = ..., num_accepted: _Optional[int] = ..., num_committed: _Optional[int] = ..., verify_batch_tokens: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ...) -> None: ...

class GenerationSummary(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "num_rounds", "accepted_per_round", "tokens_per_round", "tokens_per_second", "time_to_first_token_seconds", "elapsed_seconds", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "mean_verification_length")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_VERIFICATION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    num_rounds: int
    accepted_per_round: float
    tokens_per_round: float
    tokens_per_second: float
    time_to_first_token_seconds: float
    elapsed_seconds: float
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    mean_verification_length: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., num_rounds: _Optional[int] = ..., accepted_per_round: _Optional[float] = ..., tokens_per_round: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., elapsed_seconds: _Optional[float] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., mean_verification_length: _Optional[float] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "default_model", "policies", "default_policy")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_POLICY_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    default_model: str
    policies: _containers.RepeatedScalarFieldContainer[str]
    default_policy: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., default_model: _Optional[str] = ..., policies: _Optional[_Iterable[str]] = ..., default_policy: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "max_context_length", "drafters", "default_drafter")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    max_context_length: int
    drafters: _containers.RepeatedScalarFieldContainer[str]
    default_drafter: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., drafters: _Optional[_Iterable[str]] = ..., default_drafter: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "generated_prompt_tokens", "context_feature_rows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    generated_prompt_tokens: int
    context_feature_rows: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., generated_prompt_tokens: _Optional[int] = ..., context_feature_rows: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "anchor_token_id", "anchor_position", "context_features", "stopped", "finish_reason", "stats", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_POSITION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    anchor_token_id: int
    anchor_position: int
    context_features: ContextFeatures
    stopped: bool
    finish_reason: FinishReason
    stats: StepStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., anchor_token_id: _Optional[int] = ..., anchor_position: _Optional[int] = ..., context_features: _Optional[_Union[ContextFeatures, _Mapping]] = ..., stopped: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("request_id", "anchor_token_id", "anchor_position", "draft_token_ids", "draft_supports")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SUPPORTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    anchor_token_id: int
    anchor_position: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_supports: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    def __init__(self, request_id: _Optional[str] = ..., anchor_token_id: _Optional[int] = ..., anchor_position: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_supports: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "stats")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    stats: StepStats
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "status", "error_message", "num_accepted", "committed_token_ids", "stopped", "finish_reason", "context_features", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: ItemStatus
    error_message: str
    num_accepted: int
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stopped: bool
    finish_reason: FinishReason
    context_features: ContextFeatures
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[ItemStatus, str]] = ..., error_message: _Optional[str] = ..., num_accepted: _Optional[int] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., stopped: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., context_features: _Optional[_Union[ContextFeatures, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "generated_token_ids", "include_context_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_context_features: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., include_context_features: _Optional[bool] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("request_id", "anchor_token_id", "anchor_position", "context_features", "stopped", "finish_reason", "stats", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_POSITION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    anchor_token_id: int
    anchor_position: int
    context_features: ContextFeatures
    stopped: bool
    finish_reason: FinishReason
    stats: StepStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., anchor_token_id: _Optional[int] = ..., anchor_position: _Optional[int] = ..., context_features: _Optional[_Union[ContextFeatures, _Mapping]] = ..., stopped: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifierServiceReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifierServiceReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class VerifierServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierServiceGetInfoResponse(_message.Message):
    __slots__ = ("verifier_id", "model_name", "vocab_size", "tap_layer_ids", "hidden_size", "max_context_length", "feature_dtype", "eos_token_ids", "max_batch_tokens", "max_active_requests", "sps_table")
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TAP_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SPS_TABLE_FIELD_NUMBER: _ClassVar[int]
    verifier_id: str
    model_name: str
    vocab_size: int
    tap_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    max_context_length: int
    feature_dtype: Dtype
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_batch_tokens: int
    max_active_requests: int
    sps_table: SpsTable
    def __init__(self, verifier_id: _Optional[str] = ..., model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tap_layer_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., feature_dtype: _Optional[_Union[Dtype, str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_batch_tokens: _Optional[int] = ..., max_active_requests: _Optional[int] = ..., sps_table: _Optional[_Union[SpsTable, _Mapping]] = ...) -> None: ...

class SpsTable(_message.Message):
    __slots__ = ("points", "rows")
    POINTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[SpsPoint]
    rows: _containers.RepeatedCompositeFieldContainer[SpsRow]
    def __init__(self, points: _Optional[_Iterable[_Union[SpsPoint, _Mapping]]] = ..., rows: _Optional[_Iterable[_Union[SpsRow, _Mapping]]] = ...) -> None: ...

class SpsRow(_message.Message):
    __slots__ = ("num_requests", "points")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    points: _containers.RepeatedCompositeFieldContainer[SpsPoint]
    def __init__(self, num_requests: _Optional[int] = ..., points: _Optional[_Iterable[_Union[SpsPoint, _Mapping]]] = ...) -> None: ...

class SpsPoint(_message.Message):
    __slots__ = ("num_tokens", "steps_per_second")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    steps_per_second: float
    def __init__(self, num_tokens: _Optional[int] = ..., steps_per_second: _Optional[float] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class ProposeItem(_message.Message):
    __slots__ = ("request_id", "context_features", "anchor_token_id", "anchor_position", "temperature", "seed", "max_draft_tokens", "context_token_ids", "coupling_seed", "processing", "begins_context")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_POSITION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    BEGINS_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_features: ContextFeatures
    anchor_token_id: int
    anchor_position: int
    temperature: float
    seed: int
    max_draft_tokens: int
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    coupling_seed: int
    processing: DraftProcessing
    begins_context: bool
    def __init__(self, request_id: _Optional[str] = ..., context_features: _Optional[_Union[ContextFeatures, _Mapping]] = ..., anchor_token_id: _Optional[int] = ..., anchor_position: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., context_token_ids: _Optional[_Iterable[int]] = ..., coupling_seed: _Optional[int] = ..., processing: _Optional[_Union[DraftProcessing, _Mapping]] = ..., begins_context: _Optional[bool] = ...) -> None: ...

class DraftProcessing(_message.Message):
    __slots__ = ("params", "prompt_token_ids", "output_token_ids")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    params: SamplingParams
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals", "stats")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    stats: StepStats
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("request_id", "status", "error_message", "draft_token_ids", "draft_supports", "confidences", "context_length", "processed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SUPPORTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: ItemStatus
    error_message: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_supports: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    context_length: int
    processed: bool
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[ItemStatus, str]] = ..., error_message: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_supports: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., confidences: _Optional[_Iterable[float]] = ..., context_length: _Optional[int] = ..., processed: _Optional[bool] = ...) -> None: ...

class DrafterServiceReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DrafterServiceReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class DrafterServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterServiceGetInfoResponse(_message.Message):
    __slots__ = ("drafter_id", "drafter_name", "kind", "sequential_head", "has_confidence_head", "block_size", "max_support_size", "target_model_name", "target_layer_ids", "target_hidden_size", "request_history", "request_history_greedy")
    DRAFTER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQUENTIAL_HEAD_FIELD_NUMBER: _ClassVar[int]
    HAS_CONFIDENCE_HEAD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORT_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HISTORY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HISTORY_GREEDY_FIELD_NUMBER: _ClassVar[int]
    drafter_id: str
    drafter_name: str
    kind: DrafterKind
    sequential_head: SequentialHead
    has_confidence_head: bool
    block_size: int
    max_support_size: int
    target_model_name: str
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    target_hidden_size: int
    request_history: ConfidenceHistory
    request_history_greedy: ConfidenceHistory
    def __init__(self, drafter_id: _Optional[str] = ..., drafter_name: _Optional[str] = ..., kind: _Optional[_Union[DrafterKind, str]] = ..., sequential_head: _Optional[_Union[SequentialHead, str]] = ..., has_confidence_head: _Optional[bool] = ..., block_size: _Optional[int] = ..., max_support_size: _Optional[int] = ..., target_model_name: _Optional[str] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., target_hidden_size: _Optional[int] = ..., request_history: _Optional[_Union[ConfidenceHistory, _Mapping]] = ..., request_history_greedy: _Optional[_Union[ConfidenceHistory, _Mapping]] = ...) -> None: ...

class ConfidenceHistory(_message.Message):
    __slots__ = ("weights", "strength", "prior")
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    PRIOR_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    strength: float
    prior: float
    def __init__(self, weights: _Optional[_Iterable[float]] = ..., strength: _Optional[float] = ..., prior: _Optional[float] = ...) -> None: ...
