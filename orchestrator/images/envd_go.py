"""The compiled envd: a static Go binary from envd/go and protos/envd.proto, built on the host, cached by its inputs.

Go and its gRPC libraries come from Debian's packages (no module proxy is reachable): `golang-go`,
`golang-google-grpc-dev`, `golang-google-protobuf-dev` and `protoc-gen-go-grpc`. The build runs in GOPATH mode over
/usr/share/gocode, the protobuf code is generated with the venv's grpc_tools.protoc, and the binary is linked
statically (CGO off), so the image needs nothing else to run it.

`python -m orchestrator.images.envd_go [OUT]` builds it and prints its path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from orchestrator.core.errors import ImageBuildError
from orchestrator.images.cache import default_cache_dir, file_lock

GOPATH_SYSTEM = "/usr/share/gocode"
GO_PACKAGES = ("golang-go", "golang-google-grpc-dev", "golang-google-protobuf-dev", "protoc-gen-go-grpc")
# the Go import path of the generated code and of the daemon inside the build's GOPATH
PB_IMPORT = "envfleet/envdpb"
MAIN_IMPORT = "envfleet/envd"
BUILD_TIMEOUT_S = 600.0


def sources() -> dict[str, Path]:
    """What the binary is built from: envd/go/*.go and protos/envd.proto (name -> file), found where the envd and
    protos packages are (a checkout, or an installed envfleet: the wheel carries them as package data)."""
    found: dict[str, Path] = {}
    for package, pattern, prefix in (("envd", "go/*.go", "go/"), ("protos", "envd.proto", "")):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ImageBuildError(f"package {package!r} is not importable; is envfleet installed?", step="envd-go")
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.glob(pattern)):
            if not path.name.endswith("_test.go"):
                found[prefix + path.name] = path
    if "envd.proto" not in found or len(found) < 2:
        raise ImageBuildError("envd's Go sources (envd/go/*.go, protos/envd.proto) are missing", step="envd-go")
    return found


def _toolchain() -> str:
    """The go command; fails with what to install."""
    go = shutil.which("go")
    if go is None or not Path(GOPATH_SYSTEM, "src/google.golang.org/grpc").is_dir():
        raise ImageBuildError(
            "building envd needs Go and Debian's Go gRPC packages on the host: "
            f"apt-get install -y {' '.join(GO_PACKAGES)}",
            step="envd-go",
        )
    return go


def inputs_key(files: dict[str, Path] | None = None) -> str:
    """A hash of the sources: the cache key of the binary, and a label of the base image (so a base image that
    exists is found without Go on the machine; a new Go or gRPC package alone does not rebuild it)."""
    h = hashlib.sha256()
    for name, path in sorted((files or sources()).items()):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_envd_binary(cache_dir: Path | None = None) -> Path:
    """The path of the compiled envd for these sources, building it if the cache has none (about 30 s cold)."""
    cache = cache_dir or default_cache_dir()
    files = sources()
    key = inputs_key(files)
    out = cache / "envd-go" / key / "envd"
    if out.is_file():
        return out
    with file_lock(cache / "locks", f"envd-go-{key}"):
        if out.is_file():
            return out
        work = out.parent / "build"
        shutil.rmtree(work, ignore_errors=True)
        _build(_toolchain(), files, work, out)
        shutil.rmtree(work, ignore_errors=True)
    return out


def _run(cmd: list[str], env: dict[str, str], step: str) -> str:
    """Runs `cmd` and returns its stdout; raises ImageBuildError with the end of its output where it failed."""
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if r.returncode != 0:
        raise ImageBuildError(f"{step} failed ({' '.join(cmd[:3])} ...):\n{(r.stdout + r.stderr)[-4000:]}", step=step)
    return r.stdout


def _prepare(go: str, files: dict[str, Path], work: Path, gocache: Path) -> dict[str, str]:
    """A GOPATH under `work` holding the generated gRPC code and envd's sources; returns the environment to build in."""
    gopath = work / "gopath"
    pb_dir = gopath / "src" / PB_IMPORT
    main_dir = gopath / "src" / MAIN_IMPORT
    bin_dir = work / "bin"
    for d in (pb_dir, main_dir, bin_dir):
        d.mkdir(parents=True)
    env = {
        **os.environ,
        "GOPATH": f"{gopath}:{GOPATH_SYSTEM}",
        "GO111MODULE": "off",
        "GOFLAGS": "",
        "CGO_ENABLED": "0",
        "GOCACHE": str(gocache),
        "GOBIN": str(bin_dir),
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
    }
    _run([go, "install", "google.golang.org/protobuf/cmd/protoc-gen-go"], env, "envd-go protoc-gen-go")
    proto = files["envd.proto"]
    mapping = f"M{proto.name}={PB_IMPORT}"
    _run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto.parent}",
            f"--go_out={pb_dir}",
            "--go_opt=paths=source_relative",
            f"--go_opt={mapping}",
            f"--go-grpc_out={pb_dir}",
            "--go-grpc_opt=paths=source_relative",
            f"--go-grpc_opt={mapping}",
            proto.name,
        ],
        env,
        "envd-go protoc",
    )
    for name, path in files.items():
        if name.startswith("go/"):
            shutil.copyfile(path, main_dir / Path(name).name)
    return env


def _build(go: str, files: dict[str, Path], work: Path, out: Path) -> None:
    env = _prepare(go, files, work, out.parent.parent / "gocache")
    tmp = out.with_suffix(".tmp")
    _run(
        [go, "build", "-trimpath", "-ldflags=-w -buildid=", "-o", str(tmp), MAIN_IMPORT],
        env,
        "envd-go build",
    )
    tmp.replace(out)


def run_tests(work: Path, cache_dir: Path | None = None) -> str:
    """`go test` over envd's Go sources and their tests (envd/go/*_test.go, which the binary leaves out), built in
    `work`; returns its output, and raises ImageBuildError (with that output) where a test failed."""
    files = sources()
    for path in sorted(Path(files["go/main.go"]).parent.glob("*_test.go")):
        files["go/" + path.name] = path
    go = _toolchain()
    env = _prepare(go, files, work, (cache_dir or default_cache_dir()) / "envd-go" / "gocache")
    return _run([go, "test", "-count=1", "-v", MAIN_IMPORT], env, "envd-go test")


if __name__ == "__main__":
    target = build_envd_binary()
    if len(sys.argv) > 1:
        shutil.copyfile(target, sys.argv[1])
        os.chmod(sys.argv[1], 0o755)
        target = Path(sys.argv[1])
    print(target)
