"""The servicers: thin adapters from the wire to the JobManager and the Registry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from orchestrator.errors import InvalidRequestError
from orchestrator.jobs import JobManager
from orchestrator.registry import Registry
from orchestrator.server.convert import batch_to_pb, environment_pb, job_spec_from_pb, job_status_pb
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
    """List and Describe registered environments."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    @staticmethod
    def _image(env: object) -> str:
        spec = env.image_spec()  # type: ignore[attr-defined]
        return "envfleet/base" if spec is None else f"built from an ImageSpec on {spec.base or 'envfleet/base'}"

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


class RolloutService(pb_grpc.RolloutServiceServicer):  # type: ignore[misc]
    """Jobs and the rollout stream."""

    def __init__(self, jobs: JobManager) -> None:
        self._jobs = jobs

    async def SubmitJob(self, request: pb.JobSpec, context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        job_id, total = await self._jobs.submit(job_spec_from_pb(request))
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
            job_id, request.resume_after, request.max_in_flight or 256, request.max_batch or 64
        ):
            yield batch_to_pb(batch)

    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckResponse:
        if len(request.ids) > 100_000:
            raise InvalidRequestError("at most 100000 ids per Ack")
        acked = await self._jobs.ack(_job_id(request.job_id), request.up_to, list(request.ids))
        return pb.AckResponse(acked=acked)

    async def UpdatePolicy(self, request: pb.UpdatePolicyRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        if not request.version:
            raise InvalidRequestError("version is empty: name the new policy version")
        info = await self._jobs.update_policy(_job_id(request.job_id), request.version, request.base_url)
        return job_status_pb(info)

    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        return job_status_pb(await self._jobs.cancel(_job_id(request.job_id)))

    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.JobStatus:
        return job_status_pb(await self._jobs.info(_job_id(request.job_id)))

    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[job_status_pb(i) for i in await self._jobs.list()])
