from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class PrefillPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_PATH_UNSPECIFIED: _ClassVar[PrefillPath]
    PREFILL_PATH_DISAGGREGATED: _ClassVar[PrefillPath]
    PREFILL_PATH_LOCAL: _ClassVar[PrefillPath]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_UNIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_ROUTER: _ClassVar[WorkerRole]

class KVTransferBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_BACKEND_UNSPECIFIED: _ClassVar[KVTransferBackend]
    KV_TRANSFER_BACKEND_GRPC: _ClassVar[KVTransferBackend]
    KV_TRANSFER_BACKEND_NCCL: _ClassVar[KVTransferBackend]
    KV_TRANSFER_BACKEND_GLOO: _ClassVar[KVTransferBackend]

class KVLinkStoreOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LINK_STORE_OP_UNSPECIFIED: _ClassVar[KVLinkStoreOp]
    KV_LINK_STORE_OP_SET: _ClassVar[KVLinkStoreOp]
    KV_LINK_STORE_OP_GET: _ClassVar[KVLinkStoreOp]
    KV_LINK_STORE_OP_ADD: _ClassVar[KVLinkStoreOp]
    KV_LINK_STORE_OP_WAIT: _ClassVar[KVLinkStoreOp]
    KV_LINK_STORE_OP_CHECK: _ClassVar[KVLinkStoreOp]
    KV_LINK_STORE_OP_COMPARE_SET: _ClassVar[KVLinkStoreOp]
    KV_LINK_STORE_OP_DELETE: _ClassVar[KVLinkStoreOp]
    KV_LINK_STORE_OP_NUM_KEYS: _ClassVar[KVLinkStoreOp]

class KVTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KVTier]
    KV_TIER_DEVICE: _ClassVar[KVTier]
    KV_TIER_HOST: _ClassVar[KVTier]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
PREFILL_PATH_UNSPECIFIED: PrefillPath
PREFILL_PATH_DISAGGREGATED: PrefillPath
PREFILL_PATH_LOCAL: PrefillPath
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_UNIFIED: WorkerRole
WORKER_ROLE_ROUTER: WorkerRole
KV_TRANSFER_BACKEND_UNSPECIFIED: KVTransferBackend
KV_TRANSFER_BACKEND_GRPC: KVTransferBackend
KV_TRANSFER_BACKEND_NCCL: KVTransferBackend
KV_TRANSFER_BACKEND_GLOO: KVTransferBackend
KV_LINK_STORE_OP_UNSPECIFIED: KVLinkStoreOp
KV_LINK_STORE_OP_SET: KVLinkStoreOp
KV_LINK_STORE_OP_GET: KVLinkStoreOp
KV_LINK_STORE_OP_ADD: KVLinkStoreOp
KV_LINK_STORE_OP_WAIT: KVLinkStoreOp
KV_LINK_STORE_OP_CHECK: KVLinkStoreOp
KV_LINK_STORE_OP_COMPARE_SET: KVLinkStoreOp
KV_LINK_STORE_OP_DELETE: KVLinkStoreOp
KV_LINK_STORE_OP_NUM_KEYS: KVLinkStoreOp
KV_TIER_UNSPECIFIED: KVTier
KV_TIER_DEVICE: KVTier
KV_TIER_HOST: KVTier

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens_false", "logit_bias", "structured_outputs", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FALSE_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens_false: bool
    logit_bias: _containers.ScalarMap[int, float]
    structured_outputs: StructuredOutputs
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens_false: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: ChoiceList
    grammar: str
    json_object: bool
    disable_any_whitespace: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DisaggregationParams(_message.Message):
    __slots__ = ("prefill_address", "min_prompt_tokens")
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MIN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_address: str
    min_prompt_tokens: int
    def __init__(self, prefill_address: _Optional[str] = ..., min_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling_params", "stream", "disaggregation", "cache_salt", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling_params: SamplingParams
    stream: bool
    disaggregation: DisaggregationParams
    cache_salt: _containers.RepeatedScalarFieldContainer[str]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[bool] = ..., disaggregation: _Optional[_Union[DisaggregationParams, _Mapping]] = ..., cache_salt: _Optional[_Iterable[str]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "prefill_s", "kv_transfer_s", "e2e_s", "remote")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    prefill_s: float
    kv_transfer_s: float
    e2e_s: float
    remote: Timings
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., remote: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs", "usage", "timings", "finish_reason", "stop_string", "stop_token_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    usage: Usage
    timings: Timings
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class CompletionChoice(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finish_reason", "stop_string", "stop_token_id", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateComplete(_message.Message):
    __slots__ = ("choices", "usage", "timings", "prefill_path", "prompt_token_ids", "prompt_logprobs")
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PATH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedCompositeFieldContainer[CompletionChoice]
    usage: Usage
    timings: Timings
    prefill_path: PrefillPath
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, choices: _Optional[_Iterable[_Union[CompletionChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prefill_path: _Optional[_Union[PrefillPath, str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    complete: GenerateComplete
    error: GenerateError
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateComplete, _Mapping]] = ..., error: _Optional[_Union[GenerateError, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "order", "kv_scales")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    order: str
    kv_scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., order: _Optional[str] = ..., kv_scales: _Optional[_Iterable[float]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("role", "model", "model_id", "dtype", "block_size", "kv_layout", "num_kv_blocks", "max_model_len", "vocab_size", "device", "worker_id", "version", "num_free_kv_blocks", "disagg_min_prompt_tokens", "tensor_parallel_size", "pipeline_parallel_size", "rank_devices", "compute_domain", "all_reduce")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISAGG_MIN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_DEVICES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    ALL_REDUCE_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    model: str
    model_id: str
    dtype: str
    block_size: int
    kv_layout: KVLayout
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    device: str
    worker_id: str
    version: str
    num_free_kv_blocks: int
    disagg_min_prompt_tokens: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    rank_devices: _containers.RepeatedScalarFieldContainer[str]
    compute_domain: str
    all_reduce: str
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., kv_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_kv_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., device: _Optional[str] = ..., worker_id: _Optional[str] = ..., version: _Optional[str] = ..., num_free_kv_blocks: _Optional[int] = ..., disagg_min_prompt_tokens: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., rank_devices: _Optional[_Iterable[str]] = ..., compute_domain: _Optional[str] = ..., all_reduce: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "skip_blocks", "decode_worker_id", "expected_layout", "cache_salt", "lease_s", "kv_transfer_backend", "link_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    skip_blocks: int
    decode_worker_id: str
    expected_layout: KVLayout
    cache_salt: _containers.RepeatedScalarFieldContainer[str]
    lease_s: float
    kv_transfer_backend: KVTransferBackend
    link_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., skip_blocks: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., expected_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., cache_salt: _Optional[_Iterable[str]] = ..., lease_s: _Optional[float] = ..., kv_transfer_backend: _Optional[_Union[KVTransferBackend, str]] = ..., link_id: _Optional[str] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("layout", "num_prompt_tokens", "num_blocks", "first_block", "backend")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    num_prompt_tokens: int
    num_blocks: int
    first_block: int
    backend: KVTransferBackend
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., first_block: _Optional[int] = ..., backend: _Optional[_Union[KVTransferBackend, str]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("first_block", "num_blocks", "first_layer", "num_layers", "data")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    num_blocks: int
    first_layer: int
    num_layers: int
    data: bytes
    def __init__(self, first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "num_cached_tokens", "timings", "prompt_logprobs", "sampler_state")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: TokenLogprob
    num_cached_tokens: int
    timings: Timings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    sampler_state: bytes
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., sampler_state: _Optional[bytes] = ...) -> None: ...

class KVLinkRequest(_message.Message):
    __slots__ = ("link_id", "decode_worker_id", "backend", "layout", "rank_heads")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANK_HEADS_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    decode_worker_id: str
    backend: KVTransferBackend
    layout: KVLayout
    rank_heads: _containers.RepeatedCompositeFieldContainer[KVRankHeads]
    def __init__(self, link_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., backend: _Optional[_Union[KVTransferBackend, str]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., rank_heads: _Optional[_Iterable[_Union[KVRankHeads, _Mapping]]] = ...) -> None: ...

class KVRankHeads(_message.Message):
    __slots__ = ("heads",)
    HEADS_FIELD_NUMBER: _ClassVar[int]
    heads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, heads: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLinkReady(_message.Message):
    __slots__ = ("store_prefix", "timeout_s", "rpc_store", "rank_heads")
    STORE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RPC_STORE_FIELD_NUMBER: _ClassVar[int]
    RANK_HEADS_FIELD_NUMBER: _ClassVar[int]
    store_prefix: str
    timeout_s: float
    rpc_store: bool
    rank_heads: _containers.RepeatedCompositeFieldContainer[KVRankHeads]
    def __init__(self, store_prefix: _Optional[str] = ..., timeout_s: _Optional[float] = ..., rpc_store: _Optional[bool] = ..., rank_heads: _Optional[_Iterable[_Union[KVRankHeads, _Mapping]]] = ...) -> None: ...

class KVLinkStoreRequest(_message.Message):
    __slots__ = ("link_id", "op", "key", "value", "expected", "amount", "keys", "timeout_s")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    op: KVLinkStoreOp
    key: str
    value: bytes
    expected: bytes
    amount: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, link_id: _Optional[str] = ..., op: _Optional[_Union[KVLinkStoreOp, str]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class KVLinkStoreResponse(_message.Message):
    __slots__ = ("value", "number", "ok")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    number: int
    ok: bool
    def __init__(self, value: _Optional[bytes] = ..., number: _Optional[int] = ..., ok: _Optional[bool] = ...) -> None: ...

class KVLinkChunk(_message.Message):
    __slots__ = ("request_id", "seq", "first_block", "num_blocks", "first_layer", "num_layers", "num_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    first_block: int
    num_blocks: int
    first_layer: int
    num_layers: int
    num_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class KVLinkHeartbeat(_message.Message):
    __slots__ = ("sent_unix_s",)
    SENT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    sent_unix_s: float
    def __init__(self, sent_unix_s: _Optional[float] = ...) -> None: ...

class KVLinkMessage(_message.Message):
    __slots__ = ("ready", "chunk", "heartbeat")
    READY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ready: KVLinkReady
    chunk: KVLinkChunk
    heartbeat: KVLinkHeartbeat
    def __init__(self, ready: _Optional[_Union[KVLinkReady, _Mapping]] = ..., chunk: _Optional[_Union[KVLinkChunk, _Mapping]] = ..., heartbeat: _Optional[_Union[KVLinkHeartbeat, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "header", "kv", "done", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    header: KVHeader
    kv: KVChunk
    done: PrefillDone
    error: GenerateError
    def __init__(self, request_id: _Optional[str] = ..., header: _Optional[_Union[KVHeader, _Mapping]] = ..., kv: _Optional[_Union[KVChunk, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ..., error: _Optional[_Union[GenerateError, _Mapping]] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class BlockStoredEvent(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    tier: KVTier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., tier: _Optional[_Union[KVTier, str]] = ...) -> None: ...

class BlockRemovedEvent(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksClearedEvent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStoredEvent
    removed: BlockRemovedEvent
    cleared: AllBlocksClearedEvent
    def __init__(self, stored: _Optional[_Union[BlockStoredEvent, _Mapping]] = ..., removed: _Optional[_Union[BlockRemovedEvent, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksClearedEvent, _Mapping]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "queued_prefill_tokens", "kv_cache_usage", "num_kv_blocks", "num_preemptions", "busy_fraction", "prefill_tokens_per_s", "host_reload_cost", "external_prefix_cache_hits", "kv_receive_s_per_token", "host_dropped_blocks")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    HOST_RELOAD_COST_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVE_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOST_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_preemptions: int
    busy_fraction: float
    prefill_tokens_per_s: float
    host_reload_cost: float
    external_prefix_cache_hits: int
    kv_receive_s_per_token: float
    host_dropped_blocks: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_kv_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., host_reload_cost: _Optional[float] = ..., external_prefix_cache_hits: _Optional[int] = ..., kv_receive_s_per_token: _Optional[float] = ..., host_dropped_blocks: _Optional[int] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "sequence", "events", "load", "sent_unix_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    sequence: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    load: WorkerLoad
    sent_unix_s: float
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., sent_unix_s: _Optional[float] = ...) -> None: ...
