from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_MODE_UNSPECIFIED: _ClassVar[TokenMode]
    TOKEN_MODE_CHAT: _ClassVar[TokenMode]
    TOKEN_MODE_TITO: _ClassVar[TokenMode]

class Advantage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADVANTAGE_UNSPECIFIED: _ClassVar[Advantage]
    ADVANTAGE_GRPO: _ClassVar[Advantage]
    ADVANTAGE_DR_GRPO: _ClassVar[Advantage]
    ADVANTAGE_RLOO: _ClassVar[Advantage]
    ADVANTAGE_NONE: _ClassVar[Advantage]

class RolloutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_STATUS_UNSPECIFIED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_OK: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_TRUNCATED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_TIMEOUT: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_POLICY_ERROR: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_ENV_ERROR: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_INFRA_ERROR: _ClassVar[RolloutStatus]

class TokenStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_STATUS_UNSPECIFIED: _ClassVar[TokenStatus]
    TOKEN_STATUS_COMPLETE: _ClassVar[TokenStatus]
    TOKEN_STATUS_MISSING: _ClassVar[TokenStatus]
    TOKEN_STATUS_INCONSISTENT: _ClassVar[TokenStatus]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_COMPLETED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class SandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_STATE_UNSPECIFIED: _ClassVar[SandboxState]
    SANDBOX_STATE_RUNNING: _ClassVar[SandboxState]
    SANDBOX_STATE_EXPIRED: _ClassVar[SandboxState]
    SANDBOX_STATE_DELETED: _ClassVar[SandboxState]
    SANDBOX_STATE_DIED: _ClassVar[SandboxState]
TOKEN_MODE_UNSPECIFIED: TokenMode
TOKEN_MODE_CHAT: TokenMode
TOKEN_MODE_TITO: TokenMode
ADVANTAGE_UNSPECIFIED: Advantage
ADVANTAGE_GRPO: Advantage
ADVANTAGE_DR_GRPO: Advantage
ADVANTAGE_RLOO: Advantage
ADVANTAGE_NONE: Advantage
ROLLOUT_STATUS_UNSPECIFIED: RolloutStatus
ROLLOUT_STATUS_OK: RolloutStatus
ROLLOUT_STATUS_TRUNCATED: RolloutStatus
ROLLOUT_STATUS_TIMEOUT: RolloutStatus
ROLLOUT_STATUS_POLICY_ERROR: RolloutStatus
ROLLOUT_STATUS_ENV_ERROR: RolloutStatus
ROLLOUT_STATUS_INFRA_ERROR: RolloutStatus
TOKEN_STATUS_UNSPECIFIED: TokenStatus
TOKEN_STATUS_COMPLETE: TokenStatus
TOKEN_STATUS_MISSING: TokenStatus
TOKEN_STATUS_INCONSISTENT: TokenStatus
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_COMPLETED: JobState
JOB_STATE_CANCELLED: JobState
SANDBOX_STATE_UNSPECIFIED: SandboxState
SANDBOX_STATE_RUNNING: SandboxState
SANDBOX_STATE_EXPIRED: SandboxState
SANDBOX_STATE_DELETED: SandboxState
SANDBOX_STATE_DIED: SandboxState

class EnvironmentArchive(_message.Message):
    __slots__ = ("kind", "name", "version", "archive", "visibility")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    version: str
    archive: bytes
    visibility: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[str] = ..., archive: _Optional[bytes] = ..., visibility: _Optional[str] = ...) -> None: ...

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("environments",)
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentInfo]
    def __init__(self, environments: _Optional[_Iterable[_Union[EnvironmentInfo, _Mapping]]] = ...) -> None: ...

class DescribeEnvironmentRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ToolInfo(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("name", "version", "description", "num_tasks", "tools", "image", "default_max_turns", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    description: str
    num_tasks: int
    tools: _containers.RepeatedCompositeFieldContainer[ToolInfo]
    image: str
    default_max_turns: int
    source: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., description: _Optional[str] = ..., num_tasks: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[ToolInfo, _Mapping]]] = ..., image: _Optional[str] = ..., default_max_turns: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class TaskSelection(_message.Message):
    __slots__ = ("kind", "ids", "count", "seed")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[TaskSelection.Kind]
        KIND_IDS: _ClassVar[TaskSelection.Kind]
        KIND_SAMPLE: _ClassVar[TaskSelection.Kind]
        KIND_ALL: _ClassVar[TaskSelection.Kind]
    KIND_UNSPECIFIED: TaskSelection.Kind
    KIND_IDS: TaskSelection.Kind
    KIND_SAMPLE: TaskSelection.Kind
    KIND_ALL: TaskSelection.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    kind: TaskSelection.Kind
    ids: _containers.RepeatedScalarFieldContainer[str]
    count: int
    seed: int
    def __init__(self, kind: _Optional[_Union[TaskSelection.Kind, str]] = ..., ids: _Optional[_Iterable[str]] = ..., count: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens", "seed", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class PolicyEndpoint(_message.Message):
    __slots__ = ("base_url", "model", "api_key", "version", "request_timeout_s", "max_retries", "tokenizer", "tool_parser", "stream", "chat_template_kwargs", "outage_wait_s")
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TOOL_PARSER_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    OUTAGE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    base_url: str
    model: str
    api_key: str
    version: str
    request_timeout_s: float
    max_retries: int
    tokenizer: str
    tool_parser: str
    stream: bool
    chat_template_kwargs: str
    outage_wait_s: float
    def __init__(self, base_url: _Optional[str] = ..., model: _Optional[str] = ..., api_key: _Optional[str] = ..., version: _Optional[str] = ..., request_timeout_s: _Optional[float] = ..., max_retries: _Optional[int] = ..., tokenizer: _Optional[str] = ..., tool_parser: _Optional[str] = ..., stream: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ..., outage_wait_s: _Optional[float] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("env", "tasks", "group_size", "sampling", "policy", "max_concurrency", "priority", "max_turns", "rollout_timeout_s", "max_infra_retries", "deliver_groups", "advantage", "token_mode", "max_model_len")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_INFRA_RETRIES_FIELD_NUMBER: _ClassVar[int]
    DELIVER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    env: str
    tasks: TaskSelection
    group_size: int
    sampling: SamplingParams
    policy: PolicyEndpoint
    max_concurrency: int
    priority: int
    max_turns: int
    rollout_timeout_s: float
    max_infra_retries: int
    deliver_groups: bool
    advantage: Advantage
    token_mode: TokenMode
    max_model_len: int
    def __init__(self, env: _Optional[str] = ..., tasks: _Optional[_Union[TaskSelection, _Mapping]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., policy: _Optional[_Union[PolicyEndpoint, _Mapping]] = ..., max_concurrency: _Optional[int] = ..., priority: _Optional[int] = ..., max_turns: _Optional[int] = ..., rollout_timeout_s: _Optional[float] = ..., max_infra_retries: _Optional[int] = ..., deliver_groups: _Optional[bool] = ..., advantage: _Optional[_Union[Advantage, str]] = ..., token_mode: _Optional[_Union[TokenMode, str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id", "num_rollouts")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    num_rollouts: int
    def __init__(self, job_id: _Optional[str] = ..., num_rollouts: _Optional[int] = ...) -> None: ...

class StreamRolloutsRequest(_message.Message):
    __slots__ = ("job_id", "resume_after", "max_in_flight", "max_batch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    resume_after: int
    max_in_flight: int
    max_batch: int
    def __init__(self, job_id: _Optional[str] = ..., resume_after: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("role", "text", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("status_name", "status", "prompt_ids", "completion_ids", "completion_mask", "completion_logprobs")
    STATUS_NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_MASK_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    status_name: str
    status: TokenStatus
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_mask: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, status_name: _Optional[str] = ..., status: _Optional[_Union[TokenStatus, str]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., completion_mask: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue", "sandbox_acquire", "setup", "generation", "tools", "scoring", "total")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    SCORING_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    queue: float
    sandbox_acquire: float
    setup: float
    generation: float
    tools: float
    scoring: float
    total: float
    def __init__(self, queue: _Optional[float] = ..., sandbox_acquire: _Optional[float] = ..., setup: _Optional[float] = ..., generation: _Optional[float] = ..., tools: _Optional[float] = ..., scoring: _Optional[float] = ..., total: _Optional[float] = ...) -> None: ...

class Provenance(_message.Message):
    __slots__ = ("image", "image_id", "env_version", "seed", "policy_model", "policy_version")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    POLICY_MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    image: str
    image_id: str
    env_version: str
    seed: int
    policy_model: str
    policy_version: str
    def __init__(self, image: _Optional[str] = ..., image_id: _Optional[str] = ..., env_version: _Optional[str] = ..., seed: _Optional[int] = ..., policy_model: _Optional[str] = ..., policy_version: _Optional[str] = ...) -> None: ...

class RolloutError(_message.Message):
    __slots__ = ("kind", "message")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("id", "job_id", "env", "task_id", "group_id", "sample_index", "policy_version", "status", "reward", "reward_components", "metrics", "turns", "tokens", "timing", "provenance", "error", "attempts", "seq", "advantage", "started_at", "finished_at")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    env: str
    task_id: str
    group_id: str
    sample_index: int
    policy_version: str
    status: RolloutStatus
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    metrics: _containers.ScalarMap[str, float]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    tokens: Tokens
    timing: Timing
    provenance: Provenance
    error: RolloutError
    attempts: int
    seq: int
    advantage: float
    started_at: float
    finished_at: float
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., env: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., policy_version: _Optional[str] = ..., status: _Optional[_Union[RolloutStatus, str]] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., provenance: _Optional[_Union[Provenance, _Mapping]] = ..., error: _Optional[_Union[RolloutError, _Mapping]] = ..., attempts: _Optional[int] = ..., seq: _Optional[int] = ..., advantage: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "task_id", "rollouts", "failed", "more")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    task_id: str
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    failed: int
    more: bool
    def __init__(self, group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ..., failed: _Optional[int] = ..., more: _Optional[bool] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ("rollouts", "groups")
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    def __init__(self, rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("job_id", "up_to", "ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UP_TO_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    up_to: int
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., up_to: _Optional[int] = ..., ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class UpdatePolicyRequest(_message.Message):
    __slots__ = ("job_id", "version", "base_url", "api_key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: str
    base_url: str
    api_key: str
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[str] = ..., base_url: _Optional[str] = ..., api_key: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state_name", "state", "env", "total", "done", "by_status", "acked", "in_flight", "rollouts_per_s", "policy_version", "created_at", "finished_at")
    class ByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state_name: str
    state: JobState
    env: str
    total: int
    done: int
    by_status: _containers.ScalarMap[str, int]
    acked: int
    in_flight: int
    rollouts_per_s: float
    policy_version: str
    created_at: float
    finished_at: float
    def __init__(self, job_id: _Optional[str] = ..., state_name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., env: _Optional[str] = ..., total: _Optional[int] = ..., done: _Optional[int] = ..., by_status: _Optional[_Mapping[str, int]] = ..., acked: _Optional[int] = ..., in_flight: _Optional[int] = ..., rollouts_per_s: _Optional[float] = ..., policy_version: _Optional[str] = ..., created_at: _Optional[float] = ..., finished_at: _Optional[float] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class SandboxLimits(_message.Message):
    __slots__ = ("memory_mb", "cpus", "pids", "tmp_mb", "workspace_mb")
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    TMP_MB_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_MB_FIELD_NUMBER: _ClassVar[int]
    memory_mb: int
    cpus: float
    pids: int
    tmp_mb: int
    workspace_mb: int
    def __init__(self, memory_mb: _Optional[int] = ..., cpus: _Optional[float] = ..., pids: _Optional[int] = ..., tmp_mb: _Optional[int] = ..., workspace_mb: _Optional[int] = ...) -> None: ...

class ImageSource(_message.Message):
    __slots__ = ("dockerfile", "base", "packages", "files", "setup", "env")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DOCKERFILE_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    dockerfile: str
    base: str
    packages: _containers.RepeatedScalarFieldContainer[str]
    files: _containers.ScalarMap[str, str]
    setup: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    def __init__(self, dockerfile: _Optional[str] = ..., base: _Optional[str] = ..., packages: _Optional[_Iterable[str]] = ..., files: _Optional[_Mapping[str, str]] = ..., setup: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TaskSpec(_message.Message):
    __slots__ = ("id", "prompt", "data_json", "files", "reference")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    DATA_JSON_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    data_json: str
    files: _containers.ScalarMap[str, str]
    reference: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., data_json: _Optional[str] = ..., files: _Optional[_Mapping[str, str]] = ..., reference: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class ScoringSpec(_message.Message):
    __slots__ = ("command", "timeout_s", "min_reference_reward")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MIN_REFERENCE_REWARD_FIELD_NUMBER: _ClassVar[int]
    command: str
    timeout_s: float
    min_reference_reward: float
    def __init__(self, command: _Optional[str] = ..., timeout_s: _Optional[float] = ..., min_reference_reward: _Optional[float] = ...) -> None: ...

class EnvironmentSpec(_message.Message):
    __slots__ = ("name", "version", "description", "image", "tasks", "tasks_jsonl", "tools", "scoring", "limits", "system_prompt", "max_turns", "tool_timeout_s", "setup_command", "visibility", "runtime")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    TASKS_JSONL_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    SCORING_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SETUP_COMMAND_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    description: str
    image: ImageSource
    tasks: _containers.RepeatedCompositeFieldContainer[TaskSpec]
    tasks_jsonl: str
    tools: _containers.RepeatedScalarFieldContainer[str]
    scoring: ScoringSpec
    limits: SandboxLimits
    system_prompt: str
    max_turns: int
    tool_timeout_s: float
    setup_command: str
    visibility: str
    runtime: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., description: _Optional[str] = ..., image: _Optional[_Union[ImageSource, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[TaskSpec, _Mapping]]] = ..., tasks_jsonl: _Optional[str] = ..., tools: _Optional[_Iterable[str]] = ..., scoring: _Optional[_Union[ScoringSpec, _Mapping]] = ..., limits: _Optional[_Union[SandboxLimits, _Mapping]] = ..., system_prompt: _Optional[str] = ..., max_turns: _Optional[int] = ..., tool_timeout_s: _Optional[float] = ..., setup_command: _Optional[str] = ..., visibility: _Optional[str] = ..., runtime: _Optional[str] = ...) -> None: ...

class ValidationReport(_message.Message):
    __slots__ = ("env", "image", "num_tasks", "reference_task_id", "reference_reward", "reference_components", "duration_s", "checks", "tasks")
    class ReferenceComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ENV_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_REWARD_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    env: str
    image: str
    num_tasks: int
    reference_task_id: str
    reference_reward: float
    reference_components: _containers.ScalarMap[str, float]
    duration_s: float
    checks: _containers.RepeatedScalarFieldContainer[str]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskValidation]
    def __init__(self, env: _Optional[str] = ..., image: _Optional[str] = ..., num_tasks: _Optional[int] = ..., reference_task_id: _Optional[str] = ..., reference_reward: _Optional[float] = ..., reference_components: _Optional[_Mapping[str, float]] = ..., duration_s: _Optional[float] = ..., checks: _Optional[_Iterable[str]] = ..., tasks: _Optional[_Iterable[_Union[TaskValidation, _Mapping]]] = ...) -> None: ...

class TaskValidation(_message.Message):
    __slots__ = ("task_id", "reference_reward", "empty_reward")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_REWARD_FIELD_NUMBER: _ClassVar[int]
    EMPTY_REWARD_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reference_reward: float
    empty_reward: float
    def __init__(self, task_id: _Optional[str] = ..., reference_reward: _Optional[float] = ..., empty_reward: _Optional[float] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("env", "task_id", "seed", "max_turns")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_id: str
    seed: int
    max_turns: int
    def __init__(self, env: _Optional[str] = ..., task_id: _Optional[str] = ..., seed: _Optional[int] = ..., max_turns: _Optional[int] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("text", "messages", "tools")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[Turn]
    tools: _containers.RepeatedCompositeFieldContainer[ToolInfo]
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[ToolInfo, _Mapping]]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("env", "task_id", "seed", "turn", "max_turns", "image", "idle_ttl_s", "steps_by_turn")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_TURN_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_id: str
    seed: int
    turn: int
    max_turns: int
    image: str
    idle_ttl_s: float
    steps_by_turn: bool
    def __init__(self, env: _Optional[str] = ..., task_id: _Optional[str] = ..., seed: _Optional[int] = ..., turn: _Optional[int] = ..., max_turns: _Optional[int] = ..., image: _Optional[str] = ..., idle_ttl_s: _Optional[float] = ..., steps_by_turn: _Optional[bool] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("session_id", "observation", "info")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    observation: Observation
    info: SessionInfo
    def __init__(self, session_id: _Optional[str] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., info: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("tool_call", "final_answer")
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    FINAL_ANSWER_FIELD_NUMBER: _ClassVar[int]
    tool_call: ToolCall
    final_answer: str
    def __init__(self, tool_call: _Optional[_Union[ToolCall, _Mapping]] = ..., final_answer: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action", "turn")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: Action
    turn: int
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[_Union[Action, _Mapping]] = ..., turn: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "terminated", "truncated", "status", "reward_components", "metrics", "error", "info")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    status: RolloutStatus
    reward_components: _containers.ScalarMap[str, float]
    metrics: _containers.ScalarMap[str, float]
    error: RolloutError
    info: SessionInfo
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ..., status: _Optional[_Union[RolloutStatus, str]] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., error: _Optional[_Union[RolloutError, _Mapping]] = ..., info: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("was_running",)
    WAS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    was_running: bool
    def __init__(self, was_running: _Optional[bool] = ...) -> None: ...

class CreateSandboxRequest(_message.Message):
    __slots__ = ("image", "env", "limits", "ttl_s", "env_vars", "runtime")
    class EnvVarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ENV_VARS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    image: str
    env: str
    limits: SandboxLimits
    ttl_s: float
    env_vars: _containers.ScalarMap[str, str]
    runtime: str
    def __init__(self, image: _Optional[str] = ..., env: _Optional[str] = ..., limits: _Optional[_Union[SandboxLimits, _Mapping]] = ..., ttl_s: _Optional[float] = ..., env_vars: _Optional[_Mapping[str, str]] = ..., runtime: _Optional[str] = ...) -> None: ...

class SandboxInfo(_message.Message):
    __slots__ = ("sandbox_id", "image", "env", "state_name", "state", "limits", "created_at", "expires_at", "ended_at", "end_reason", "runtime")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    STATE_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    image: str
    env: str
    state_name: str
    state: SandboxState
    limits: SandboxLimits
    created_at: float
    expires_at: float
    ended_at: float
    end_reason: str
    runtime: str
    def __init__(self, sandbox_id: _Optional[str] = ..., image: _Optional[str] = ..., env: _Optional[str] = ..., state_name: _Optional[str] = ..., state: _Optional[_Union[SandboxState, str]] = ..., limits: _Optional[_Union[SandboxLimits, _Mapping]] = ..., created_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., end_reason: _Optional[str] = ..., runtime: _Optional[str] = ...) -> None: ...

class GetSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[SandboxInfo]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[SandboxInfo, _Mapping]]] = ...) -> None: ...

class Argv(_message.Message):
    __slots__ = ("args",)
    ARGS_FIELD_NUMBER: _ClassVar[int]
    args: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, args: _Optional[_Iterable[str]] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("sandbox_id", "shell", "argv", "cwd", "env", "stdin", "timeout_s", "max_output_bytes")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    shell: str
    argv: Argv
    cwd: str
    env: _containers.ScalarMap[str, str]
    stdin: bytes
    timeout_s: float
    max_output_bytes: int
    def __init__(self, sandbox_id: _Optional[str] = ..., shell: _Optional[str] = ..., argv: _Optional[_Union[Argv, _Mapping]] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., stdin: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., max_output_bytes: _Optional[int] = ...) -> None: ...

class ExecInput(_message.Message):
    __slots__ = ("request", "stdin")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    request: ExecRequest
    stdin: bytes
    def __init__(self, request: _Optional[_Union[ExecRequest, _Mapping]] = ..., stdin: _Optional[bytes] = ...) -> None: ...

class ExecStarted(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class ExecEnded(_message.Message):
    __slots__ = ("exit_code", "signal", "timed_out", "truncated", "oom_killed", "duration_s")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    timed_out: bool
    truncated: bool
    oom_killed: bool
    duration_s: float
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., truncated: _Optional[bool] = ..., oom_killed: _Optional[bool] = ..., duration_s: _Optional[float] = ...) -> None: ...

class ExecEvent(_message.Message):
    __slots__ = ("started", "stdout", "stderr", "ended")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    started: ExecStarted
    stdout: bytes
    stderr: bytes
    ended: ExecEnded
    def __init__(self, started: _Optional[_Union[ExecStarted, _Mapping]] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., ended: _Optional[_Union[ExecEnded, _Mapping]] = ...) -> None: ...

class SandboxReadFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "max_bytes")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    max_bytes: int
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class SandboxReadFileResponse(_message.Message):
    __slots__ = ("content", "truncated")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    content: bytes
    truncated: bool
    def __init__(self, content: _Optional[bytes] = ..., truncated: _Optional[bool] = ...) -> None: ...

class SandboxWriteFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "content", "mode")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    content: bytes
    mode: int
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., content: _Optional[bytes] = ..., mode: _Optional[int] = ...) -> None: ...

class SandboxWriteFileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SandboxUploadRequest(_message.Message):
    __slots__ = ("sandbox_id", "dest_dir", "tar")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_DIR_FIELD_NUMBER: _ClassVar[int]
    TAR_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    dest_dir: str
    tar: bytes
    def __init__(self, sandbox_id: _Optional[str] = ..., dest_dir: _Optional[str] = ..., tar: _Optional[bytes] = ...) -> None: ...

class SandboxUploadResponse(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: int
    def __init__(self, files: _Optional[int] = ...) -> None: ...

class SandboxDownloadRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class SandboxDownloadResponse(_message.Message):
    __slots__ = ("tar",)
    TAR_FIELD_NUMBER: _ClassVar[int]
    tar: bytes
    def __init__(self, tar: _Optional[bytes] = ...) -> None: ...

class DeleteSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class DeleteSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
