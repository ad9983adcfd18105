"""SWE evaluation throughput: `run_evaluation` with workers=2 against a plain script doing the same evaluation with
`docker run` + `docker exec` per instance, on the same instance images, on the same host, interleaved.

Both sides evaluate the gold patch of the same instances with the same hardening (no network, read-only root,
tmpfs /tmp and /workspace, uid 1000, no capabilities, pids/memory/CPU limits) and grade with the same parser, so
the difference is the machinery: envd (one exec carrying the whole evaluation) and background sandbox removal
against the docker CLI's per-step execs and a synchronous `docker rm -f`.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import docker

from environments.swe.builder.pins import INSTANCES
from environments.swe.evaluate import SWE_LIMITS, run_evaluation
from environments.swe.grading import PARSERS, grade_tests, resolution
from environments.swe.images import ensure_images
from environments.swe.instance import SweInstance, gold_predictions, load_instances
from environments.swe.script import EVAL_ENV, UNITTEST_RUNNER, test_command
from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig

log = logging.getLogger("bench.swe")

WORKERS = 2


def _sample(instances: list[SweInstance], count: int) -> list[SweInstance]:
    """`count` instances spread over the projects (round robin), in a stable order."""
    by_repo: dict[str, list[SweInstance]] = {}
    for inst in instances:
        by_repo.setdefault(inst.repo, []).append(inst)
    out: list[SweInstance] = []
    while len(out) < count and any(by_repo.values()):
        for repo in sorted(by_repo):
            if by_repo[repo] and len(out) < count:
                out.append(by_repo[repo].pop(0))
    return out


async def _docker(*args: str, stdin: bytes | None = None) -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(
        "docker",
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate(stdin)
    return proc.returncode or 0, out


def _run_flags(image: str) -> list[str]:
    lim = SWE_LIMITS
    return [
        "run", "-d", "--network", "none", "--read-only", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--init", "--user", "99999:99999",
        "--pids-limit", str(lim.pids), "--memory", f"{lim.memory_mb}m", "--cpus", str(lim.cpus),
        "--tmpfs", f"/tmp:rw,exec,nosuid,nodev,size={lim.tmp_mb}m,mode=1777",
        # the workspace is the sandbox uid's, as envfleet's own sandboxes mount it (uid 1000 left the baseline,
        # which runs as 99999, unable to write it: every instance failed and `make bench` stopped there)
        "--tmpfs", f"/workspace:rw,exec,nosuid,nodev,size={lim.workspace_mb}m,uid=99999,gid=99999,mode=0755",
        "--label", "envfleet.bench=swe-baseline",
        *(x for k, v in EVAL_ENV.items() for x in ("-e", f"{k}={v}")),
        image, "sleep", "infinity",
    ]  # fmt: skip


async def _baseline_one(inst: SweInstance, image: str) -> bool:
    """The plain way: docker run, docker exec per step (patch in, apply, tests), docker rm -f; graded alike."""
    code, out = await _docker(*_run_flags(image))
    cid = out.decode().strip()
    if code != 0:
        raise RuntimeError(f"docker run failed: {out.decode()[-500:]}")
    try:
        await _docker("exec", "-i", cid, "sh", "-c", "cat > /tmp/model.patch", stdin=inst.patch.encode())
        if inst.test_runner.framework == "unittest":
            await _docker("exec", "-i", cid, "sh", "-c", "cat > /tmp/swe_unittest.py", stdin=UNITTEST_RUNNER.encode())
        code, out = await _docker("exec", "-w", "/workspace", cid, "sh", "-c", "cp -a /opt/repo/. /workspace/")
        if code != 0:
            raise RuntimeError(f"the baseline could not copy the repository: {out.decode()[-500:]}")
        code, out = await _docker("exec", "-w", "/workspace", cid, "git", "apply", "/tmp/model.patch")
        if code != 0:
            return False
        cmd = shlex.join(test_command(inst)).replace("/tmp/swe/unittest_runner.py", "/tmp/swe_unittest.py")
        pythonpath = ":".join(f"/workspace/{p}" for p in inst.test_runner.pythonpath)
        env = ["-e", f"PYTHONPATH={pythonpath}"] if pythonpath else []
        code, out = await _docker("exec", "-w", "/workspace", *env, cid, "sh", "-c", f"timeout 300 {cmd} 2>&1")
        statuses = PARSERS[inst.test_runner.framework](out.decode(errors="replace"))
        tests = grade_tests(statuses, inst.FAIL_TO_PASS, inst.PASS_TO_PASS, inst.gold())  # as the harness grades
        return resolution(tests).value == "RESOLVED_FULL"
    finally:
        await _docker("rm", "-f", cid)


async def _baseline(instances: list[SweInstance], images: dict[str, str]) -> tuple[float, int]:
    queue = list(instances)
    resolved = 0

    async def worker() -> None:
        nonlocal resolved
        while queue:
            inst = queue.pop(0)
            ok = await _baseline_one(inst, images[inst.instance_id])  # not `+= await`: that reads before awaiting
            resolved += ok

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(WORKERS)))
    return time.perf_counter() - t0, resolved


async def _envfleet(
    instances: list[SweInstance], client: docker.DockerClient, owner: str, *, reuse: bool
) -> tuple[float, int]:
    backend = await DockerBackend.start(DockerBackendConfig(owner=owner), sweep=False)
    with tempfile.TemporaryDirectory(prefix="swe-bench-") as tmp:
        t0 = time.perf_counter()
        try:
            summary = await run_evaluation(
                instances,
                gold_predictions(instances),
                run_id="bench",
                backend=backend,
                client=client,
                workers=WORKERS,
                log_dir=Path(tmp),
                reuse_sandboxes=reuse,
            )
        finally:
            await backend.close()  # timed too: it waits for the sandboxes removed in the background
        seconds = time.perf_counter() - t0
    resolved = summary["resolved_instances"]
    assert isinstance(resolved, int)
    return seconds, resolved


async def swe_eval_throughput(count: int = 16, rounds: int = 3, owner: str = "envfleet-bench") -> dict[str, Any]:
    """Instances evaluated per minute with workers=2: envfleet against docker run + docker exec on the instance
    images. `envfleet_*` is the harness on warm, recycled sandboxes (`--reuse-sandboxes`); `fresh_*` is its default,
    a fresh sandbox of the instance image per instance, as SWE-bench does."""
    client = docker.from_env()
    instances = _sample(load_instances(INSTANCES), count)
    images = await asyncio.to_thread(ensure_images, client, instances, workers=WORKERS)
    await _baseline_one(instances[0], images[instances[0].instance_id])  # warm both paths once
    await _envfleet(instances[:2], client, owner, reuse=True)
    pooled: list[float] = []
    fresh: list[float] = []
    base: list[float] = []

    async def envfleet(reuse: bool, out: list[float]) -> None:
        seconds, ok = await _envfleet(instances, client, owner, reuse=reuse)
        assert ok == len(instances), f"envfleet resolved {ok}/{len(instances)}"
        out.append(seconds)

    async def baseline() -> None:
        seconds, ok = await _baseline(instances, images)
        assert ok == len(instances), f"baseline resolved {ok}/{len(instances)}"
        base.append(seconds)

    sides = [lambda: envfleet(True, pooled), lambda: envfleet(False, fresh), baseline]
    for r in range(rounds):  # interleaved, each side first in turn, so a host's drift hits all three alike
        for side in sides[r % 3 :] + sides[: r % 3]:
            await side()

    def per_min(xs: list[float]) -> float:
        return 60 * len(instances) / statistics.median(xs)

    e, f, b = per_min(pooled), per_min(fresh), per_min(base)
    return {
        "envfleet_instances_per_min": round(e, 2),
        "baseline_instances_per_min": round(b, 2),
        "ratio": round(e / b, 3),
        "fresh_instances_per_min": round(f, 2),
        "fresh_ratio": round(f / b, 3),
        "instances": len(instances),
        "rounds": rounds,
        "workers": WORKERS,
    }


if __name__ == "__main__":
    import json

    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(asyncio.run(swe_eval_throughput()), indent=2))
