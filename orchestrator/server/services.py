"""The servicers: thin adapters from the wire to the JobManager and the Registry.

Every call acts as the calling tenant (from its bearer token): a tenant sees only its own jobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from orchestrator.core.environment import Environment
from orchestrator.core.errors import FailedPreconditionError, InvalidRequestError
from orchestrator.core.models import MAX_TASK_IDS
from orchestrator.core.runtime import to_the_end
from orchestrator.rollout.tito.parsers import get_parser
from orchestrator.rollout.tito.tokenizer import TokenizerDirs
from orchestrator.server.convert import batch_to_pb, environment_pb, job_spec_from_pb, job_status_pb
from orchestrator.server.convert_specs import archive_from_pb, spec_from_pb, validation_report_pb
from orchestrator.server.replies import UnreadReplies, unread_replies
from orchestrator.server.security import Authenticator, PolicyURLs, ReplayGate
from orchestrator.service.jobs import MAX_ROLLOUTS_PER_JOB, JobManager
from orchestrator.service.registration import Registrar
from orchestrator.service.registry import Registry
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

M = TypeVar("M")
T = TypeVar("T")

MAX_IN_FLIGHT = 100_000
MAX_BATCH = 10_000
DEFAULT_MAX_IN_FLIGHT = 256
DEFAULT_MAX_BATCH = 64
MAX_ACK_IDS = 100_000
# Every identifier a caller sends is capped here, before it reaches a lookup or an error message.
MAX_ID = 128  # job, task, session and sandbox ids (Reset's task_id too)
MAX_ENV_REF = 200  # name@version
MAX_NAME = 256  # a policy's model name, a policy version
MAX_URL = 2048
MAX_SECRET = 4096  # a policy's API key
MAX_STOP = 64  # stop strings, each at most MAX_NAME


def capped(value: str, what: str, limit: int, *, required: bool = False) -> str:
    """`value` unchanged if it is at most `limit` characters (and present when required); else INVALID_ARGUMENT."""
    if required and not value:
        raise InvalidRequestError(f"{what} is empty")
    if len(value) > limit:
        raise InvalidRequestError(f"{what} is too long ({len(value)} characters, the limit is {limit})")
    return value


def _job_id(job_id: str) -> str:
    return capped(job_id, "job_id", MAX_ID, required=True)


def check_job_spec(m: pb.JobSpec) -> None:
    """Identifier caps and the job's size (tasks x group_size), checked before the spec is even converted."""
    capped(m.env, "env", MAX_ENV_REF)
    if len(m.tasks.ids) > MAX_TASK_IDS:  # counted first: 33 million empty ids walked one by one held the loop 20 s
        raise InvalidRequestError(f"tasks.ids has {len(m.tasks.ids)} ids; the limit is {MAX_TASK_IDS}")
    for i, task_id in enumerate(m.tasks.ids):
        capped(task_id, f"tasks.ids[{i}]", MAX_ID)
    p = m.policy
    capped(p.base_url, "policy.base_url", MAX_URL)
    capped(p.model, "policy.model", MAX_NAME)
    capped(p.version, "policy.version", MAX_NAME)
    capped(p.api_key, "policy.api_key", MAX_SECRET)
    capped(p.tokenizer, "policy.tokenizer", MAX_NAME)
    capped(p.tool_parser, "policy.tool_parser", MAX_NAME)
    if len(m.sampling.stop) > MAX_STOP:
        raise InvalidRequestError(f"sampling.stop has {len(m.sampling.stop)} strings, the limit is {MAX_STOP}")
    for i, s in enumerate(m.sampling.stop):
        capped(s, f"sampling.stop[{i}]", MAX_NAME)
    # kind=all is checked by the JobManager, which knows the environment's task count, still before building items
    # (its `count`, which only KIND_SAMPLE reads, refused a job of 10 tasks as 5000 x 256 rollouts)
    kind = m.tasks.kind
    tasks = len(set(m.tasks.ids)) if kind == pb.TaskSelection.KIND_IDS else 0
    if kind == pb.TaskSelection.KIND_SAMPLE:
        tasks = m.tasks.count
    total = tasks * max(m.group_size, 1)
    if total > MAX_ROLLOUTS_PER_JOB:
        raise InvalidRequestError(
            f"tasks x group_size = {tasks} x {max(m.group_size, 1)} = {total} rollouts; "
            f"the limit per job is {MAX_ROLLOUTS_PER_JOB}"
        )


class EnvironmentService(pb_grpc.EnvironmentServiceServicer):  # type: ignore[misc]
    """List and Describe registered environments; Register and Validate declarative specs and uploaded archives."""

    def __init__(
        self,
        registry: Registry,
        registrar: Registrar | None = None,
        auth: Authenticator | None = None,
        unread: UnreadReplies | None = None,
    ) -> None:
        self._registry = registry
        self._registrar = registrar
        self._auth = auth or Authenticator()
        self._unread = unread or unread_replies()

    @staticmethod
    def _image(env: Environment) -> str:
        return env.image_description()

    async def List(
        self, request: pb.ListEnvironmentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEnvironmentsResponse:
        tenant = self._auth.tenant(context)
        visible = self._registry.all(tenant)  # another tenant's private ones are left out
        reply = pb.ListEnvironmentsResponse(
            environments=[environment_pb(r.env, r.source, self._image(r.env)) for r in visible]
        )
        return self._unread.hold(tenant, reply, context)

    async def Describe(
        self, request: pb.DescribeEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.EnvironmentInfo:
        if not request.name:
            raise InvalidRequestError("name is empty: give an environment name or name@version")
        capped(request.name, "name", MAX_ENV_REF)
        r = self._registry.lookup(request.name, self._auth.tenant(context))
        return environment_pb(r.env, r.source, self._image(r.env))

    def _registrar_or_fail(self) -> Registrar:
        if self._registrar is None:
            raise FailedPreconditionError("this server does not accept environment registrations")
        return self._registrar

    async def Register(self, request: pb.EnvironmentSpec, context: grpc.aio.ServicerContext) -> pb.EnvironmentInfo:
        tenant = self._auth.tenant(context)
        registrar = self._registrar_or_fail()
        with registrar.admitted(tenant):
            r = await registrar.register(await _converted(spec_from_pb, request), tenant)
        return environment_pb(r.env, r.source, self._image(r.env))

    async def Validate(self, request: pb.EnvironmentSpec, context: grpc.aio.ServicerContext) -> pb.ValidationReport:
        tenant = self._auth.tenant(context)
        registrar = self._registrar_or_fail()
        with registrar.admitted(tenant):
            return validation_report_pb(await registrar.validate(await _converted(spec_from_pb, request), tenant))

    async def RegisterArchive(
        self, request: pb.EnvironmentArchive, context: grpc.aio.ServicerContext
    ) -> pb.EnvironmentInfo:
        tenant = self._auth.tenant(context)
        registrar = self._registrar_or_fail()
        with registrar.admitted(tenant):
            r = await registrar.register_archive(archive_from_pb(request), tenant)
        return environment_pb(r.env, r.source, self._image(r.env))

    async def ValidateArchive(
        self, request: pb.EnvironmentArchive, context: grpc.aio.ServicerContext
    ) -> pb.ValidationReport:
        tenant = self._auth.tenant(context)
        registrar = self._registrar_or_fail()
        with registrar.admitted(tenant):
            return validation_report_pb(await registrar.validate_archive(archive_from_pb(request), tenant))


async def _converted(convert: Callable[[M], T], request: M) -> T:
    """`convert(request)` in a thread, to its end even when the call is cancelled (its admission is held until
    then): a spec of 100,000 tasks takes seconds to convert, and on the event loop it held every tenant's calls,
    streams and rollouts that long."""
    return await to_the_end(asyncio.ensure_future(asyncio.to_thread(convert, request)))


class RolloutService(pb_grpc.RolloutServiceServicer):  # type: ignore[misc]
    """Jobs and the rollout stream."""

    def __init__(
        self,
        jobs: JobManager,
        auth: Authenticator | None = None,
        policy_urls: PolicyURLs | None = None,
        tokenizers: TokenizerDirs | None = None,
        replay: ReplayGate | None = None,
        unread: UnreadReplies | None = None,
    ) -> None:
        self._jobs = jobs
        self._unread = unread or unread_replies()
        self._auth = auth or Authenticator()
        self._policy_urls = policy_urls or PolicyURLs(None)
        self._tokenizers = tokenizers or TokenizerDirs()
        self._replay = replay or ReplayGate("owner", self._auth, lambda _: None)

    async def SubmitJob(self, request: pb.JobSpec, context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        check_job_spec(request)
        self._policy_urls.check(request.policy.base_url)
        tenant = self._auth.tenant(context)
        self._replay.check(tenant, request.env, request.policy.base_url)
        spec = job_spec_from_pb(request)
        if spec.token_mode == "tito":
            # refused now, not rollout by rollout: a name this server has no folder for, a parser it lacks
            self._tokenizers.resolve(spec.policy.tokenizer)
            get_parser(spec.policy.tool_parser)
        job_id, total = await self._jobs.submit(spec, tenant)
        return pb.SubmitJobResponse(job_id=job_id, num_rollouts=total)

    async def StreamRollouts(
        self, request: pb.StreamRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RolloutBatch]:
        job_id = _job_id(request.job_id)
        if request.resume_after < 0:
            raise InvalidRequestError(f"resume_after must be >= 0, got {request.resume_after}")
        # 0 is proto3's "unset": it takes the default, as the proto says
        if not 0 <= request.max_in_flight <= MAX_IN_FLIGHT:
            raise InvalidRequestError(
                f"max_in_flight must be between 1 and {MAX_IN_FLIGHT} (0 means {DEFAULT_MAX_IN_FLIGHT}), "
                f"got {request.max_in_flight}"
            )
        if not 0 <= request.max_batch <= MAX_BATCH:
            raise InvalidRequestError(
                f"max_batch must be between 1 and {MAX_BATCH} (0 means {DEFAULT_MAX_BATCH}), got {request.max_batch}"
            )
        async for batch in self._jobs.stream(
            job_id,
            request.resume_after,
            request.max_in_flight or DEFAULT_MAX_IN_FLIGHT,
            request.max_batch or DEFAULT_MAX_BATCH,
            owner=self._auth.tenant(context),
        ):
            yield batch_to_pb(batch)

    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckResponse:
        if len(request.ids) > MAX_ACK_IDS:
            raise InvalidRequestError(f"at most {MAX_ACK_IDS} ids per Ack, got {len(request.ids)}")
        owner = self._auth.tenant(context)
        acked = await self._jobs.ack(_job_id(request.job_id), request.up_to, list(request.ids), owner=owner)
        return pb.AckResponse(acked=acked)

    async def UpdatePolicy(self, request: pb.UpdatePolicyRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        capped(request.version, "version", MAX_NAME, required=True)
        capped(request.base_url, "base_url", MAX_URL)
        capped(request.api_key, "api_key", MAX_SECRET)
        self._policy_urls.check(request.base_url)
        tenant = self._auth.tenant(context)
        if request.base_url:
            job = await self._jobs.info(_job_id(request.job_id), owner=tenant)
            self._replay.check(tenant, job.spec.env, request.base_url)
        api_key = request.api_key if request.HasField("api_key") else None
        info = await self._jobs.update_policy(
            _job_id(request.job_id), request.version, request.base_url, api_key=api_key, owner=tenant
        )
        return job_status_pb(info)

    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        return job_status_pb(await self._jobs.cancel(_job_id(request.job_id), owner=self._auth.tenant(context)))

    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        return job_status_pb(await self._jobs.info(_job_id(request.job_id), owner=self._auth.tenant(context)))

    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        tenant = self._auth.tenant(context)
        jobs = await self._jobs.list(owner=tenant)
        return self._unread.hold(tenant, pb.ListJobsResponse(jobs=[job_status_pb(i) for i in jobs]), context)
