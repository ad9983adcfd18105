"""The package layers stay true: imports point down only, the trainer SDK and the environment SDK stay light."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# orchestrator's layers, lowest first. A module may import its own layer and the layers below it; `client` sits
# beside the server stack and may import only `core`.
LAYERS = ["core", "backends", "rollout", "service", "server", "testing", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)} | {
    "images": 1,
    "client": 1,
    "worker": 4,
    "viewer": 4,
    "openenv": 4,
}
ONLY = {"client": {"core", "client"}, "core": {"core"}}


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Absolute module names that a source file imports, with their line numbers (relative imports resolved)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                out.append((node.lineno, ".".join([*base, *([node.module] if node.module else [])])))
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def _modules(package: str) -> list[tuple[Path, str]]:
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append((path, ".".join(parts)))
    return found


def layer_violations() -> list[str]:
    """Every import that points up a layer, or from the orchestrator into the environment plug-ins."""
    bad = []
    for path, module in _modules("orchestrator"):
        here = module.split(".")[1] if module.count(".") else None
        if here is None:
            continue
        for line, target in _imports(path, module):
            where = f"{path.relative_to(REPO)}:{line} imports {target}"
            if target.split(".")[0] == "environments":
                bad.append(f"{where} (the orchestrator finds environments through entry points only)")
                continue
            if not target.startswith("orchestrator."):
                continue
            there = target.split(".")[1]
            if here in ONLY and there not in ONLY[here]:
                bad.append(f"{where} ({here} may import only {sorted(ONLY[here])})")
            elif RANK[there] > RANK[here]:
                bad.append(f"{where} (an upward import: {here} is below {there})")
    return bad


# integrations/ (trainer adapters) sit on top of the trainer SDK: the client, the core types and the tokenizer-only
# tito modules (and the policy seam's ToolCall they return), never the server stack; nothing imports them back.
INTEGRATIONS_MAY_IMPORT = ("orchestrator.client", "orchestrator.core", "orchestrator.rollout.tito")
INTEGRATIONS_ALSO = ("orchestrator.rollout.policy.base", "orchestrator.rollout.tito.parsers")


def integration_violations() -> list[str]:
    """Every import from integrations/ outside the SDK layers, and every import of integrations from below."""
    bad = []
    for path, module in _modules("integrations"):
        for line, target in _imports(path, module):
            where = f"{path.relative_to(REPO)}:{line} imports {target}"
            if target.split(".")[0] == "environments":
                bad.append(f"{where} (integrations reach environments through the server only)")
            elif target.startswith("orchestrator") and not (
                target.startswith(tuple(p + "." for p in INTEGRATIONS_MAY_IMPORT))
                or target in INTEGRATIONS_MAY_IMPORT
                or target in INTEGRATIONS_ALSO
            ):
                bad.append(f"{where} (integrations may import only {', '.join(INTEGRATIONS_MAY_IMPORT)})")
    for package in ("orchestrator", "environments", "envd"):
        for path, module in _modules(package):
            for line, target in _imports(path, module):
                if target.split(".")[0] == "integrations":
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {target} (integrations are the top layer)")
    return bad


def test_imports_point_down_only() -> None:
    assert layer_violations() == []
    assert integration_violations() == []


def test_the_integration_check_catches_a_server_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "integrations").mkdir()
    (tmp_path / "integrations" / "bad.py").write_text(
        "from orchestrator.service.jobs import JobManager\nfrom orchestrator.client import EnvfleetClient\n"
    )
    (tmp_path / "orchestrator" / "core").mkdir(parents=True)
    (tmp_path / "orchestrator" / "core" / "up.py").write_text("import integrations.trl\n")
    for package in ("environments", "envd"):
        (tmp_path / package).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = integration_violations()
    assert len(found) == 2, found
    assert "integrations may import only" in found[0] and "orchestrator.service.jobs" in found[0]
    assert "integrations are the top layer" in found[1]


def test_the_layer_check_catches_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the check itself must be able to fail: a core module that imports the service layer
    fake = tmp_path / "orchestrator" / "core"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from orchestrator.service.jobs import JobManager\nimport environments.swe\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = layer_violations()
    assert len(found) == 2
    assert "core may import only ['core']" in found[0]
    assert "entry points only" in found[1]


def _loaded_after_import(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def _forbidden(loaded: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if m in prefixes or m.startswith(tuple(p + "." for p in prefixes)))


def test_the_client_sdk_loads_no_server_code() -> None:
    loaded = _loaded_after_import("orchestrator.client")
    forbidden = ("docker", "sqlite3", "httpx", "orchestrator.service", "orchestrator.backends", "orchestrator.server")
    assert _forbidden(loaded, (*forbidden, "orchestrator.rollout", "orchestrator.images", "environments")) == []
    assert "grpc" in loaded and "orchestrator.client.sdk" in loaded


def test_the_environment_sdk_loads_no_docker_and_no_httpx() -> None:
    loaded = _loaded_after_import("environments.sdk")
    assert _forbidden(loaded, ("docker", "httpx", "sqlite3", "orchestrator.service", "orchestrator.backends")) == []
    assert "orchestrator.core.environment" in loaded


def test_core_imports_no_docker_httpx_or_sqlite() -> None:
    for path, module in _modules("orchestrator/core"):
        for line, target in _imports(path, module):
            assert target.split(".")[0] not in ("docker", "httpx", "sqlite3", "requests"), f"{path}:{line}"


def test_the_server_and_the_cli_load_openenv_only_when_asked() -> None:
    # the openenv extra (OpenEnv, FastAPI, Gradio: seconds to import) is loaded by create_server only with openenv set
    heavy = ("openenv", "fastapi", "gradio", "orchestrator.openenv.serving")
    for module in ("orchestrator.server.app", "orchestrator.cli.main"):
        assert _forbidden(_loaded_after_import(module), heavy) == [], module
    assert "orchestrator.openenv.config" in _loaded_after_import("orchestrator.server.app")  # it can fail


def test_the_integrations_load_no_server_code() -> None:
    """The adapters' shared modules pull in no Docker, SQLite or server layer (their trainers are extras)."""
    loaded = _loaded_after_import("integrations.trl") | _loaded_after_import("integrations.episode")
    forbidden = ("docker", "sqlite3", "orchestrator.service", "orchestrator.backends", "orchestrator.server")
    assert _forbidden(loaded, (*forbidden, "orchestrator.testing", "environments", "trl", "torch")) == []
