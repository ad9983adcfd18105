"""A tito job's tokenizer is named by the tenant, so the name never becomes an arbitrary host path or a hub download:
it must be a plain name, it resolves only to a folder directly in the operator's tokenizer directories, and loading
never touches the network nor runs code shipped beside the files (trust_remote_code stays off)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

pytest.importorskip("transformers")

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.core.errors import ConfigError, InvalidRequestError
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.rollout.tito.tokenizer import TokenizerCache, TokenizerDirs, load_tokenizer
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.conftest import REPO, TEST_OWNER
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import expect_error, serve

HOSTILE = ["../../etc", "/etc", "/etc/passwd", "a/b", "Qwen/Qwen3-8B", "..", ".", ".hidden", "a\\b", "x\x00y", "~root"]


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tokenizers"
    shutil.copytree(QWEN_LIKE_DIR, d / "qwen-like")
    (tmp_path / "secret").mkdir()  # beside the directory: never reachable by a name
    return d


@pytest.mark.parametrize("name", HOSTILE)
def test_a_name_that_is_a_path_is_refused_with_a_message(name: str, tokenizer_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape("no path separator, no '..'")):
        TokenizerDirs([tokenizer_dir]).resolve(name)
    with pytest.raises(ValidationError, match="never as a path"):
        PolicyEndpoint(base_url="http://127.0.0.1:9/v1", tokenizer=name)


def test_only_folders_of_the_configured_directories_resolve(tokenizer_dir: Path) -> None:
    dirs = TokenizerDirs([tokenizer_dir])
    assert dirs.resolve("qwen-like") == tokenizer_dir / "qwen-like"
    assert dirs.names() == ["qwen-like"]
    with pytest.raises(InvalidRequestError, match=r"'secret' is not in this server's .* offers: qwen-like"):
        dirs.resolve("secret")
    with pytest.raises(InvalidRequestError, match="this server has no tokenizer directories"):
        TokenizerDirs([]).resolve("qwen-like")


async def test_submit_refuses_a_hostile_or_unknown_tokenizer(tmp_path: Path, tokenizer_dir: Path) -> None:
    async with (
        serve(tmp_path / "data", backend=FakeBackendConfig(owner=TEST_OWNER), tokenizer_dirs=[tokenizer_dir]) as orch,
        grpc.aio.insecure_channel(orch.address) as channel,
    ):
        stub = pb_grpc.RolloutServiceStub(channel)

        def job(tokenizer: str, tool_parser: str = "") -> pb.JobSpec:
            tasks = pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["py-000"])
            endpoint = pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1", tokenizer=tokenizer, tool_parser=tool_parser)
            return pb.JobSpec(env=ENV, tasks=tasks, policy=endpoint)

        for name in ("../../etc", "/etc/passwd"):
            await expect_error(
                stub.SubmitJob(job(name), timeout=30),
                grpc.StatusCode.INVALID_ARGUMENT,
                "policy.tokenizer",
                "never as a path",
            )
        await expect_error(
            stub.SubmitJob(job("secret"), timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "offers: qwen-like"
        )
        await expect_error(
            stub.SubmitJob(job("qwen-like", tool_parser="evil"), timeout=30),
            grpc.StatusCode.INVALID_ARGUMENT,
            "policy.tool_parser 'evil' is unknown; known: hermes",
        )
        await expect_error(
            stub.SubmitJob(
                pb.JobSpec(env=ENV, token_mode=pb.TOKEN_MODE_TITO, policy=pb.PolicyEndpoint(base_url="http://h/v1")),
                timeout=30,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_mode tito needs policy.tokenizer",
        )
        reply = await stub.SubmitJob(job("qwen-like"), timeout=30)
        assert reply.num_rollouts == 1
        await stub.CancelJob(pb.CancelJobRequest(job_id=reply.job_id), timeout=30)


async def test_a_worker_without_the_tokenizer_fails_as_configuration_not_as_a_path(tokenizer_dir: Path) -> None:
    with pytest.raises(ConfigError, match="this process cannot load the tokenizer"):
        await TokenizerCache([tokenizer_dir]).get("secret")


# Run in a fresh interpreter: every socket connection and name lookup is refused and recorded, and the hub's own
# offline switches are off, so only envfleet's loading (local_files_only) can keep it off the network.
NO_NETWORK = """
import json, os, socket, sys
for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.pop(k, None)
tried = []
def refuse(*a, **k):
    tried.append(repr(a)[:200])
    raise OSError("network disabled by the test")
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
socket.getaddrinfo = refuse
socket.create_connection = refuse
import asyncio
from pathlib import Path
from orchestrator.rollout.tito.tokenizer import TokenizerCache, load_tokenizer
tok = load_tokenizer(Path(sys.argv[1]) / "qwen-like")
cache = TokenizerCache([sys.argv[1]])
tokens = asyncio.run(cache.get("qwen-like"))
ids = tokens.prompt_ids([{"role": "user", "content": "hi"}])
try:
    asyncio.run(TokenizerCache([sys.argv[1]]).get("Qwen3-8B"))  # a hub id's last part: not here, never fetched
    missing = "loaded"
except Exception as e:
    missing = type(e).__name__
print(json.dumps({"tried": tried, "ids": len(ids), "vocab": len(tok), "missing": missing}))
"""


def test_loading_never_touches_the_network(tokenizer_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", NO_NETWORK, str(tokenizer_dir)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tried"] == [] and result["ids"] > 0 and result["vocab"] > 100
    assert result["missing"] == "ConfigError"


def test_code_shipped_beside_a_tokenizer_never_runs(tmp_path: Path, tokenizer_dir: Path) -> None:
    evil = tokenizer_dir / "evil"
    shutil.copytree(QWEN_LIKE_DIR, evil)
    config = json.loads((evil / "tokenizer_config.json").read_text())
    config |= {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}
    (evil / "tokenizer_config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (evil / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_tokenizer(evil)
    assert not marker.exists()
