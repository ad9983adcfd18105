from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Protocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_UNSPECIFIED: _ClassVar[Protocol]
    PROTOCOL_BATCHED: _ClassVar[Protocol]
PROTOCOL_UNSPECIFIED: Protocol
PROTOCOL_BATCHED: Protocol

class WorkerHello(_message.Message):
    __slots__ = ("worker_id", "host", "slots", "pid", "protocol", "acks_cancel", "instance", "keeps_specs", "release", "engine_outage_wait_s", "engine_down")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ACKS_CANCEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    KEEPS_SPECS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_OUTAGE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DOWN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    slots: int
    pid: int
    protocol: Protocol
    acks_cancel: bool
    instance: str
    keeps_specs: bool
    release: str
    engine_outage_wait_s: float
    engine_down: bool
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., slots: _Optional[int] = ..., pid: _Optional[int] = ..., protocol: _Optional[_Union[Protocol, str]] = ..., acks_cancel: _Optional[bool] = ..., instance: _Optional[str] = ..., keeps_specs: _Optional[bool] = ..., release: _Optional[str] = ..., engine_outage_wait_s: _Optional[float] = ..., engine_down: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("running", "metrics", "engine_down", "engine_waits")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DOWN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_WAITS_FIELD_NUMBER: _ClassVar[int]
    running: int
    metrics: bytes
    engine_down: bool
    engine_waits: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, running: _Optional[int] = ..., metrics: _Optional[bytes] = ..., engine_down: _Optional[bool] = ..., engine_waits: _Optional[_Iterable[str]] = ...) -> None: ...

class RolloutResult(_message.Message):
    __slots__ = ("assignment_id", "rollout_json", "rollout_pb", "error", "cancelled")
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_PB_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    rollout_json: bytes
    rollout_pb: bytes
    error: str
    cancelled: bool
    def __init__(self, assignment_id: _Optional[str] = ..., rollout_json: _Optional[bytes] = ..., rollout_pb: _Optional[bytes] = ..., error: _Optional[str] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class ResultBatch(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RolloutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RolloutResult, _Mapping]]] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "results")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    hello: WorkerHello
    heartbeat: Heartbeat
    results: ResultBatch
    def __init__(self, hello: _Optional[_Union[WorkerHello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., results: _Optional[_Union[ResultBatch, _Mapping]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("assignment_id", "job_spec_json", "job_id", "task_id", "sample_index", "queued_s", "env_spec_json", "tenant", "traceparent", "env_archive", "attempts_spent", "env_digest")
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    ENV_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    ENV_ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_SPENT_FIELD_NUMBER: _ClassVar[int]
    ENV_DIGEST_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    job_spec_json: bytes
    job_id: str
    task_id: str
    sample_index: int
    queued_s: float
    env_spec_json: bytes
    tenant: str
    traceparent: str
    env_archive: ArchiveEnvironment
    attempts_spent: int
    env_digest: str
    def __init__(self, assignment_id: _Optional[str] = ..., job_spec_json: _Optional[bytes] = ..., job_id: _Optional[str] = ..., task_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., queued_s: _Optional[float] = ..., env_spec_json: _Optional[bytes] = ..., tenant: _Optional[str] = ..., traceparent: _Optional[str] = ..., env_archive: _Optional[_Union[ArchiveEnvironment, _Mapping]] = ..., attempts_spent: _Optional[int] = ..., env_digest: _Optional[str] = ...) -> None: ...

class ArchiveEnvironment(_message.Message):
    __slots__ = ("kind", "name", "version", "sha256", "archive", "rules")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    version: str
    sha256: str
    archive: bytes
    rules: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[str] = ..., sha256: _Optional[str] = ..., archive: _Optional[bytes] = ..., rules: _Optional[str] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("assignment_id",)
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    def __init__(self, assignment_id: _Optional[str] = ...) -> None: ...

class JobEnded(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class AssignmentBatch(_message.Message):
    __slots__ = ("assignments",)
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    def __init__(self, assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("assign", "cancel", "job_ended")
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    JOB_ENDED_FIELD_NUMBER: _ClassVar[int]
    assign: AssignmentBatch
    cancel: Cancel
    job_ended: JobEnded
    def __init__(self, assign: _Optional[_Union[AssignmentBatch, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., job_ended: _Optional[_Union[JobEnded, _Mapping]] = ...) -> None: ...
