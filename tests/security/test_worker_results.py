"""What a worker sends back is checked before it becomes a rollout in the result log: a worker cannot pass a
failure off as a reward, answer for a rollout it was not given, or send what does not parse or is too large. The
checks hold on both wires (this host's unix socket and remote TCP); a remote worker's JSON is validated whole, and
a worker of another release is refused with a clear error."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from orchestrator.core.models import EncodedRollout, Rollout, RolloutError, RolloutStatus
from orchestrator.service.registry import Registry
from orchestrator.worker import results
from orchestrator.worker.results import encode
from protos import orchestrator_pb2 as pb
from protos import worker_pb2 as wpb
from tests.conftest import REPO, until
from tests.orchestrator.worker_wire import ENV, ScriptedWorker, items, rollout_for, serve_hub, spec


def _forged(a: wpb.Assignment, **update: object) -> wpb.RolloutResult:
    return encode(a.assignment_id, rollout_for(a, **update))


def _patched_pb(a: wpb.Assignment, patch: Callable[[pb.Rollout], None]) -> wpb.RolloutResult:
    r = _forged(a)
    m = pb.Rollout.FromString(r.rollout_pb)
    patch(m)
    r.rollout_pb = m.SerializeToString()
    return r


def _oversize(a: wpb.Assignment) -> wpb.RolloutResult:
    r = _forged(a)
    r.rollout_json = b" " * (results.MAX_ROLLOUT_BYTES + 1)
    return r


BAD: dict[str, tuple[Callable[[wpb.Assignment], wpb.RolloutResult], str]] = {
    "a failure with a reward": (
        lambda a: _forged(a, status=RolloutStatus.INFRA_ERROR),
        "must not carry a reward",
    ),
    "a scored rollout without one": (lambda a: _forged(a, reward=None), "needs a reward"),
    "another rollout's id": (lambda a: _forged(a, id=a.job_id + ":other:0"), "the assignment was"),
    "another job's rollout": (lambda a: _forged(a, job_id="someone-elses"), "the assignment was"),
    "a seq of its own": (lambda a: _patched_pb(a, lambda m: setattr(m, "seq", 7)), "control plane's to set"),
    "an unknown status": (lambda a: _patched_pb(a, lambda m: setattr(m, "status", 99)), "unknown rollout status"),
    "bytes that do not parse": (
        lambda a: wpb.RolloutResult(assignment_id=a.assignment_id, rollout_json=b"{}", rollout_pb=b"\xff\xff\xff\xff"),
        "does not parse",
    ),
    "a missing form": (lambda a: wpb.RolloutResult(assignment_id=a.assignment_id, rollout_json=b"{}"), "missing"),
    "an oversize rollout": (_oversize, "over"),
}


@pytest.mark.parametrize("wire", ["unix", "tcp"])
@pytest.mark.parametrize("case", list(BAD))
async def test_a_bad_result_never_becomes_a_rollout(wire: str, case: str) -> None:
    forge, why = BAD[case]

    async def answer(a: wpb.Assignment) -> wpb.RolloutResult:
        return forge(a)

    async with serve_hub() as w, ScriptedWorker(getattr(w, wire), answer):
        await w.hub.wait_for_workers(1, timeout_s=30)
        (item,) = items("job-bad", 1)
        env = Registry.from_entry_points().get(ENV)
        got = await asyncio.wait_for(w.hub.run(item, env, spec([item.task.id])), 60)
    # refused, and (no retries left) delivered as an infrastructure failure the trainer masks: never a reward
    assert isinstance(got, Rollout), got
    assert got.status == RolloutStatus.INFRA_ERROR and got.reward is None
    assert got.id == item.id and got.job_id == item.job_id
    assert got.error is not None and "sent an invalid rollout" in got.error.message
    assert why in got.error.message, got.error.message


async def _one(wire: str, answer: Callable[[wpb.Assignment], wpb.RolloutResult]) -> Rollout | EncodedRollout:
    async def reply(a: wpb.Assignment) -> wpb.RolloutResult:
        return answer(a)

    async with serve_hub() as w, ScriptedWorker(getattr(w, wire), reply):
        await w.hub.wait_for_workers(1, timeout_s=30)
        (item,) = items("job-json", 1)
        return await asyncio.wait_for(w.hub.run(item, Registry.from_entry_points().get(ENV), spec([item.task.id])), 60)


def _json_says(reward: float, extra: str = "") -> Callable[[wpb.Assignment], wpb.RolloutResult]:
    def answer(a: wpb.Assignment) -> wpb.RolloutResult:
        r = _forged(a)  # the protobuf form says reward 1.0
        r.rollout_json = rollout_for(a, reward=reward).model_dump_json(exclude={"seq"}).encode()[:-1] + extra.encode()
        r.rollout_json += b"}"
        return r

    return answer


async def test_a_remote_workers_json_must_agree_with_what_the_trainer_reads() -> None:
    got = await _one("tcp", _json_says(0.25))
    assert isinstance(got, Rollout) and got.status == RolloutStatus.INFRA_ERROR, got
    assert got.error is not None and "disagree" in got.error.message


async def test_a_remote_workers_json_is_validated_whole() -> None:
    got = await _one("tcp", _json_says(1.0, extra=', "planted": "field"'))
    assert isinstance(got, Rollout) and got.status == RolloutStatus.INFRA_ERROR, got
    assert got.error is not None and "JSON form is invalid" in got.error.message and "planted" in got.error.message


async def test_a_remote_workers_rollout_is_logged_in_the_control_planes_own_serialization() -> None:
    def spaced(a: wpb.Assignment) -> wpb.RolloutResult:
        r = _forged(a)
        r.rollout_json = b"  " + r.rollout_json.replace(b'":', b'" : ') + b"  "
        return r

    got = await _one("tcp", spaced)
    assert isinstance(got, EncodedRollout), got
    assert got.json == Rollout.model_validate_json(got.json).model_dump_json(exclude={"seq"})


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e999"])
async def test_a_remote_workers_number_that_is_not_finite_is_refused(number: str) -> None:
    # its JSON was validated with pydantic's defaults (NaN and infinities taken), then logged as null, which the log
    # could not read back: a grouped job's stream failed at that seq at every try, and its trainer never got past it
    def answer(a: wpb.Assignment) -> wpb.RolloutResult:
        r = _forged(a)
        r.rollout_json = r.rollout_json.replace(b'"metrics":{}', b'"metrics":{"x":' + number.encode() + b"}")
        assert number.encode() in r.rollout_json
        return r

    got = await _one("tcp", answer)
    assert isinstance(got, Rollout) and got.status == RolloutStatus.INFRA_ERROR, got
    assert got.error is not None and "not finite" in got.error.message, got.error


async def test_a_remote_workers_tokens_reach_the_trainer_as_its_checked_json_says() -> None:
    # the protobuf form was passed on as the worker sent it, compared with the JSON on ids, status and reward only:
    # the trainer read token ids and logprobs that the checked JSON did not hold
    def answer(a: wpb.Assignment) -> wpb.RolloutResult:
        r = _forged(a)
        m = pb.Rollout.FromString(r.rollout_pb)
        m.tokens.completion_ids.extend([7, 7, 7])
        m.metrics["x"] = float("nan")
        r.rollout_pb = m.SerializeToString()
        return r

    got = await _one("tcp", answer)
    assert isinstance(got, EncodedRollout), got
    wire = pb.Rollout.FromString(got.wire)
    assert list(wire.tokens.completion_ids) == [] and dict(wire.metrics) == {}
    assert wire == pb.Rollout.FromString(encode("x", Rollout.model_validate_json(got.json)).rollout_pb)


async def test_only_this_hosts_unix_socket_is_trusted() -> None:
    async def never(a: wpb.Assignment) -> None:
        return None

    async with (
        serve_hub() as w,
        ScriptedWorker(w.unix, never, worker_id="local"),
        ScriptedWorker(w.tcp, never, worker_id="remote"),
    ):
        await w.hub.wait_for_workers(2, timeout_s=30)
        trusted = {info.worker_id: info.trusted for info in w.hub.workers()}
    assert trusted == {"local": True, "remote": False}


async def test_a_worker_of_another_release_is_refused_with_a_clear_error() -> None:
    async def never(a: wpb.Assignment) -> None:
        return None

    async with serve_hub() as w:
        # the hello only: it is refused on that, and a heartbeat racing the refusal would garble its status
        old = ScriptedWorker(w.tcp, never, protocol=wpb.PROTOCOL_UNSPECIFIED, heartbeat_s=None)
        async with old:
            await asyncio.wait_for(old.ended(), 30)
        assert old.error is not None and old.error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "PROTOCOL_UNSPECIFIED" in (old.error.details() or "")
        assert "same envfleet release" in (old.error.details() or "")
        assert w.hub.workers() == []
        # a worker of another build of the wire's models (an in-place upgrade, a Ray node with another install): it
        # refused the newer job specs, or sent rollouts this side refused after their whole episode, each retried
        # elsewhere and ended an infrastructure error
        for build, said in (("0.0.9+0123456789abcdef", "build '0.0.9+0123456789abcdef'"), ("", "from before builds")):
            other = ScriptedWorker(w.tcp, never, release=build, heartbeat_s=None)
            async with other:
                await asyncio.wait_for(other.ended(), 30)
            assert other.error is not None and other.error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert said in (other.error.details() or "") and "same envfleet release" in (other.error.details() or "")
        assert w.hub.workers() == []


SLOTS_SAID = "slots must be between 1 and 100000"
WAIT_SAID = "engine_outage_wait_s must be between 0 and 86400"


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [("slots", n, SLOTS_SAID) for n in (0, 100_001, 2**31 - 1)]
    + [("engine_outage_wait_s", v, WAIT_SAID) for v in (-1.0, float("nan"), float("inf"), 86_401.0)],
)
async def test_a_worker_that_claims_slots_or_an_engine_wait_out_of_range_is_refused(
    field: str, value: float, said: str
) -> None:
    # its slots are the fleet's room: 2**31 of them made it the least loaded worker for good, every job's rollouts
    # went to it, and the wait for room that keeps a lost worker's share off the others was gone. Its engine wait is
    # counted into the budget of each of its assignments: a wait of 1e300 s (or NaN, which no comparison bounds) made
    # a stuck worker's rollouts never given up, their slots and their sandboxes held for good
    async def never(a: wpb.Assignment) -> None:
        return None

    async with serve_hub() as w:
        odd = ScriptedWorker(w.tcp, never, heartbeat_s=None, **{field: value})  # type: ignore[arg-type]
        async with odd:
            await asyncio.wait_for(odd.ended(), 30)
        assert odd.error is not None and odd.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert said in (odd.error.details() or "")
        assert w.hub.workers() == []


async def test_a_remote_worker_cannot_take_a_local_workers_id() -> None:
    # a remote hello with a local worker's id dropped it (its rollouts retried on others), and then the two took the
    # id from each other at every reconnect
    async def never(a: wpb.Assignment) -> None:
        return None

    async with serve_hub() as w, ScriptedWorker(w.unix, never, worker_id="w0-host-1"):
        await w.hub.wait_for_workers(1, timeout_s=30)
        impostor = ScriptedWorker(w.tcp, never, worker_id="w0-host-1", heartbeat_s=None)
        async with impostor:
            await asyncio.wait_for(impostor.ended(), 30)
        assert impostor.error is not None and impostor.error.code() == grpc.StatusCode.ALREADY_EXISTS
        assert [(i.worker_id, i.trusted) for i in w.hub.workers()] == [("w0-host-1", True)]
        assert w.hub.lost == 0


async def test_a_remote_worker_cannot_take_another_remote_workers_id() -> None:
    # ids are predictable (name, hostname, pid): a hello with a connected remote worker's id dropped it (each of its
    # rollouts retried, its sandbox destroyed), and the two then took the id from each other at every reconnect.
    # Only the same process (its instance) reconnects as that id
    async def never(a: wpb.Assignment) -> None:
        return None

    async with serve_hub() as w, ScriptedWorker(w.tcp, never, worker_id="ray-1-host-9", instance="secret-a"):
        await w.hub.wait_for_workers(1, timeout_s=30)
        for instance in ("guessed", ""):
            impostor = ScriptedWorker(w.tcp, never, worker_id="ray-1-host-9", instance=instance, heartbeat_s=None)
            async with impostor:
                await asyncio.wait_for(impostor.ended(), 30)
            assert impostor.error is not None and impostor.error.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "another worker needs its own" in (impostor.error.details() or "")
        assert [i.worker_id for i in w.hub.workers()] == ["ray-1-host-9"] and w.hub.lost == 0
        # its own reconnect (a new stream of the same process) replaces it
        async with ScriptedWorker(w.tcp, never, worker_id="ray-1-host-9", instance="secret-a"):
            for _ in range(100):
                if w.hub.lost == 1:
                    break
                await asyncio.sleep(0.05)
            assert w.hub.lost == 1 and [i.worker_id for i in w.hub.workers()] == ["ray-1-host-9"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("worker_id", "-" * 20_000),
        ("host", "h" * 1_000_000),
        ("worker_id", "w\nx"),
        ("host", ""),
        ("instance", "\u00e9" * 8),  # compared as bytes, and never past the names' bounds
        ("instance", "i" * 300),
    ],
)
async def test_a_hello_with_a_name_past_its_bounds_is_refused(field: str, value: str) -> None:
    # the id and the host label every sample of the fleet's metrics (a 1 MiB host made a 300 MiB scrape), and the
    # Ray fleet kept every dash-prefix of every id (20,000 dashes: 191 MiB)
    async def never(a: wpb.Assignment) -> None:
        return None

    async with serve_hub() as w:
        bad = ScriptedWorker(w.tcp, never, heartbeat_s=None, **{field: value})  # type: ignore[arg-type]
        async with bad:
            await asyncio.wait_for(bad.ended(), 30)
        assert bad.error is not None and bad.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"a worker's {field} is 1 to 256 of the characters" in (bad.error.details() or "")
        assert w.hub.workers() == []


async def test_a_worker_that_sends_more_results_in_a_message_than_a_batch_is_dropped() -> None:
    # a result an assignment, an outbox's batch (256) a message: 13 million empty results in one 64 MiB message held
    # the control plane's loop for seconds, and nothing stopped the next such message
    async def answer(a: wpb.Assignment) -> wpb.RolloutResult:
        return _forged(a)

    async with serve_hub() as w:
        flood = ScriptedWorker(w.tcp, answer)  # its heartbeats keep it: only the flood drops it
        async with flood:
            await w.hub.wait_for_workers(1, timeout_s=30)
            junk = wpb.ResultBatch(results=[wpb.RolloutResult(assignment_id="x")] * 257)
            flood.send(wpb.WorkerMessage(results=junk))
            await asyncio.wait_for(flood.ended(), 15)
        assert w.hub.workers() == [] and w.hub.lost == 1


async def test_a_worker_that_names_rollouts_waiting_for_its_engine_moves_only_its_own() -> None:
    # a heartbeat's engine_waits moves rollouts off their worker (WorkerHub._move_waiting): a worker that names
    # another worker's rollout, 100,000 times, beside its own, moves its own and nothing of the other's
    never_ends = asyncio.Event()

    async def never(a: wpb.Assignment) -> wpb.RolloutResult:
        await never_ends.wait()
        return _forged(a)

    theirs, mine = items("job-named", 2)
    env = Registry.from_entry_points().get(ENV)
    job = spec([theirs.task.id, mine.task.id], max_infra_retries=1)
    async with serve_hub(engine_move_after_s=0) as w, ScriptedWorker(w.tcp, never, worker_id="h", host="a") as honest:
        await w.hub.wait_for_workers(1, timeout_s=30)
        runs = [asyncio.create_task(w.hub.run(theirs, env, job))]
        try:
            await until(lambda: len(honest.assignments) == 1, "placed")
            async with ScriptedWorker(w.tcp, never, worker_id="m", host="b", slots=1) as mallory:
                await w.hub.wait_for_workers(2, timeout_s=30)
                runs.append(asyncio.create_task(w.hub.run(mine, env, job)))  # the one with room
                await until(lambda: len(mallory.assignments) == 1, "placed")
                mallory.engine_waits = [mine.id] + [theirs.id] * 100_000  # read no further than twice its slots
                mallory.engine_down = True
                await until(lambda: len(honest.assignments) == 2, "its own moved to the other host")
                assert mallory.cancelled == [mallory.assignments[0].assignment_id]
                assert honest.cancelled == [] and not runs[0].done()
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)


async def test_a_check_that_fails_on_its_own_fails_the_rollout_over_never_hangs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the assignment was taken off the worker's running rollouts before the check: a check that raised anything but
    # InvalidResultError left the rollout's future unresolved (and dropped the worker's stream)
    from orchestrator.worker import hub

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug of the check")

    monkeypatch.setattr(hub, "decode", broken)
    got = await _one("unix", _forged)
    assert isinstance(got, Rollout) and got.status == RolloutStatus.INFRA_ERROR and got.reward is None, got
    assert got.error is not None and "a bug of the check" in got.error.message, got.error


async def test_an_environments_failure_of_any_size_or_text_is_delivered_as_it_is() -> None:
    # a failure's message is the environment's exception's text: 20 MB of it made the rollout too large to send, and
    # a lone surrogate (no UTF-8 has one) made it fail to encode; on a worker either was taken for the worker's loss,
    # the episode run again on every worker in turn, and the environment's failure delivered as INFRA_ERROR
    def failed(a: wpb.Assignment) -> wpb.RolloutResult:
        error = RolloutError(kind="ValueError", message="bad \ud800 " + "x" * (20 << 20))
        return encode(a.assignment_id, rollout_for(a, status=RolloutStatus.ENV_ERROR, reward=None, error=error))

    got = await _one("unix", failed)
    assert isinstance(got, EncodedRollout), got
    rollout = Rollout.model_validate_json(got.json)
    assert rollout.status == RolloutStatus.ENV_ERROR and rollout.error is not None
    assert rollout.error.message.startswith("bad \ufffd xxx") and len(rollout.error.message) < 5000
    # and a cut message read again (the result log, a remote worker's JSON checked against its protobuf form) is
    # the same message: cut again at every reading, it changed
    assert RolloutError.model_validate_json(rollout.error.model_dump_json()) == rollout.error


def test_a_worker_whose_grading_code_differs_is_another_release(tmp_path: Path) -> None:
    # the release was the version (0.1.0 since the first commit) and the wire's schemas: a node left behind an
    # upgrade that fixed a forgeable grader had the same release, was let in, and its rewards were trusted
    from orchestrator.worker import release as release_module

    tree = tmp_path / "environments"
    shutil.copytree(REPO / "environments", tree, ignore=shutil.ignore_patterns("__pycache__"))

    def digest() -> str:
        d = hashlib.sha256()
        release_module._code(d, {"environments": [tree]})
        return d.hexdigest()

    before = digest()
    (tree / "swe" / "stray.orig").write_text("not the build's")  # no part of a wheel: the same build
    assert digest() == before
    grading = tree / "swe" / "grading.py"
    grading.write_text(grading.read_text() + "\n# one more line\n")
    assert digest() != before
    assert release_module._locations()["environments"] == [REPO / "environments"]
