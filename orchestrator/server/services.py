"""The servicers: thin adapters from the wire to the JobManager and the Registry.

Every call acts as the calling tenant (from its bearer token): a tenant sees only its own jobs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from orchestrator.core.environment import Environment
from orchestrator.core.errors import FailedPreconditionError, InvalidRequestError
from orchestrator.server.convert import batch_to_pb, environment_pb, job_spec_from_pb, job_status_pb
from orchestrator.server.convert_specs import spec_from_pb, validation_report_pb
from orchestrator.server.security import Authenticator
from orchestrator.service.jobs import JobManager
from orchestrator.service.registration import Registrar
from orchestrator.service.registry import Registry
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

MAX_IN_FLIGHT = 100_000
MAX_BATCH = 10_000


def _job_id(job_id: str) -> str:
    if not job_id:
        raise InvalidRequestError("job_id is empty")
    if len(job_id) > 128:
        raise InvalidRequestError("job_id is too long (over 128 characters)")
    return job_id


class EnvironmentService(pb_grpc.EnvironmentServiceServicer):  # type: ignore[misc]
    """List and Describe registered environments; Register and Validate declarative ones."""

    def __init__(
        self, registry: Registry, registrar: Registrar | None = None, auth: Authenticator | None = None
    ) -> None:
        self._registry = registry
        self._registrar = registrar
        self._auth = auth or Authenticator()

    @staticmethod
    def _image(env: Environment) -> str:
        return env.image_description()

    async def List(
        self, request: pb.ListEnvironmentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEnvironmentsResponse:
        return pb.ListEnvironmentsResponse(
            environments=[environment_pb(r.env, r.source, self._image(r.env)) for r in self._registry.all()]
        )

    async def Describe(
        self, request: pb.DescribeEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.EnvironmentInfo:
        if not request.name:
            raise InvalidRequestError("name is empty: give an environment name or name@version")
        r = self._registry.lookup(request.name)
        return environment_pb(r.env, r.source, self._image(r.env))

    def _registrar_or_fail(self) -> Registrar:
        if self._registrar is None:
            raise FailedPreconditionError("this server does not accept environment registrations")
        return self._registrar

    async def Register(self, request: pb.EnvironmentSpec, context: grpc.aio.ServicerContext) -> pb.EnvironmentInfo:
        tenant = self._auth.tenant(context)
        r = await self._registrar_or_fail().register(spec_from_pb(request), tenant)
        return environment_pb(r.env, r.source, self._image(r.env))

    async def Validate(self, request: pb.EnvironmentSpec, context: grpc.aio.ServicerContext) -> pb.ValidationReport:
        self._auth.tenant(context)
        return validation_report_pb(await self._registrar_or_fail().validate(spec_from_pb(request)))


class RolloutService(pb_grpc.RolloutServiceServicer):  # type: ignore[misc]
    """Jobs and the rollout stream."""

    def __init__(self, jobs: JobManager, auth: Authenticator | None = None) -> None:
        self._jobs = jobs
        self._auth = auth or Authenticator()

    async def SubmitJob(self, request: pb.JobSpec, context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        job_id, total = await self._jobs.submit(job_spec_from_pb(request), self._auth.tenant(context))
        return pb.SubmitJobResponse(job_id=job_id, num_rollouts=total)

    async def StreamRollouts(
        self, request: pb.StreamRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RolloutBatch]:
        job_id = _job_id(request.job_id)
        if request.resume_after < 0:
            raise InvalidRequestError(f"resume_after must be >= 0, got {request.resume_after}")
        if not 0 <= request.max_in_flight <= MAX_IN_FLIGHT:
            raise InvalidRequestError(
                f"max_in_flight must be between 1 and {MAX_IN_FLIGHT}, got {request.max_in_flight}"
            )
        if not 0 <= request.max_batch <= MAX_BATCH:
            raise InvalidRequestError(f"max_batch must be between 1 and {MAX_BATCH}, got {request.max_batch}")
        async for batch in self._jobs.stream(
            job_id,
            request.resume_after,
            request.max_in_flight or 256,
            request.max_batch or 64,
            owner=self._auth.tenant(context),
        ):
            yield batch_to_pb(batch)

    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckResponse:
        if len(request.ids) > 100_000:
            raise InvalidRequestError("at most 100000 ids per Ack")
        owner = self._auth.tenant(context)
        acked = await self._jobs.ack(_job_id(request.job_id), request.up_to, list(request.ids), owner=owner)
        return pb.AckResponse(acked=acked)

    async def UpdatePolicy(self, request: pb.UpdatePolicyRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        if not request.version:
            raise InvalidRequestError("version is empty: name the new policy version")
        info = await self._jobs.update_policy(
            _job_id(request.job_id), request.version, request.base_url, owner=self._auth.tenant(context)
        )
        return job_status_pb(info)

    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        return job_status_pb(await self._jobs.cancel(_job_id(request.job_id), owner=self._auth.tenant(context)))

    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        return job_status_pb(await self._jobs.info(_job_id(request.job_id), owner=self._auth.tenant(context)))

    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        jobs = await self._jobs.list(owner=self._auth.tenant(context))
        return pb.ListJobsResponse(jobs=[job_status_pb(i) for i in jobs])
