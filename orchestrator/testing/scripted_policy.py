"""A scripted OpenAI-compatible chat completions server: the stand-in for vLLM in demos and tests.

It replays a Script (policy_script.py): per task, one Step per assistant turn (text, tool calls, or a fault: an HTTP
error status or a hang). The task comes from the request's `user` field, the rollout id
"<job_id>:<task_id>:<sample_index>"; the turn is the number of assistant messages already in the conversation. Token
ids and logprobs come from the toy tokenizer, in vLLM's response fields, so a client can be checked token for token.

The app is a plain ASGI callable (policy_app.ScriptedPolicyApp) served by uvicorn, as vLLM's own server is; HTTP
parsing, keep-alive and flow control are uvicorn's. It replaced a hand-written asyncio HTTP/1.1 server after
measuring both side by side (bench/policy_server.py has the figures): with httptools it spends less CPU per request.

With the qwen3 template (Script.template, or --template qwen3) it is a model server double instead: the offline
Qwen-like tokenizer and chat template, /v1/completions with token-id prompts, answers sampled as ids with <think> and
hermes tool calls, every sample logged (qwen_policy.py; needs the `tito` extra).

    python -m orchestrator.testing.scripted_policy --script script.json [--port 0] [--host 127.0.0.1] [--no-tokens]
        [--template prefix|drop_history|qwen3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import get_args

import uvicorn
from pydantic import ValidationError

from orchestrator.server.asgi import LISTEN_BACKLOG, EmbeddedUvicorn, bind_listener
from orchestrator.testing.policy_app import MAX_BODY, ScriptedPolicyApp
from orchestrator.testing.policy_script import Script, ScriptedToolCall, Step, Template, sample_of, task_of
from orchestrator.testing.qwen_policy import Sample

# What tests, demos and benches import from here (the script model lives in policy_script, the app in policy_app).
__all__ = [
    "MAX_BODY",
    "Sample",
    "Script",
    "ScriptedPolicyApp",
    "ScriptedServer",
    "ScriptedToolCall",
    "Step",
    "main",
    "sample_of",
    "start_scripted_server",
    "task_of",
]

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 2.0
# Idle keep-alive connections are closed after this long. vLLM's uvicorn uses 5 s; a test double waits longer, so a
# slow test never races the server's close of a pooled connection.
KEEP_ALIVE_S = 300
START_TIMEOUT_S = 10.0


class _Uvicorn(EmbeddedUvicorn):
    """uvicorn.Server embedded in a running loop: no signal handlers, an event once listening, and a prompt stop.

    Library code installs no signal handlers (the CLI's _serve handles SIGTERM and SIGINT). uvicorn's own main loop
    polls for exit every 0.1 s and its shutdown sleeps and polls too, about 190 ms per close, which the test suite
    would pay once per scripted server; here both wait on events and close in a few ms.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stop = asyncio.Event()

    async def main_loop(self) -> None:
        """Serve until stop is set (no per-tick work: the date and server headers are off)."""
        await self.stop.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop listening, let each request finish its response, then cancel what is left after the grace."""
        for server in self.servers:
            server.close()
        for conn in list(self.server_state.connections):
            conn.shutdown()  # idle ones close now, busy ones after their response
        busy = set(self.server_state.tasks)  # the requests being answered; their connections close after
        if busy:
            _, stuck = await asyncio.wait(busy, timeout=CLOSE_GRACE_S)
            if stuck:
                log.warning("scripted server: cancelling %d request(s) still open after %gs", len(stuck), CLOSE_GRACE_S)
            for task in stuck:
                task.cancel()
        for server in self.servers:
            await server.wait_closed()


class ScriptedServer:
    """A running scripted server (uvicorn serving ScriptedPolicyApp); counts chat completion requests and faults."""

    def __init__(self, script: Script, *, tokens: bool = True) -> None:
        self.app = ScriptedPolicyApp(script, tokens=tokens)
        self._host = "127.0.0.1"
        self._port = 0
        self._uvicorn: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def script(self) -> Script:
        """The script being replayed."""
        return self.app.script

    @property
    def tokens(self) -> bool:
        """Whether token ids and logprobs are returned when asked for."""
        return self.app.tokens

    @property
    def requests(self) -> int:
        """Completion requests received, chat and (qwen3) plain, faults included."""
        return self.app.requests

    @property
    def samples(self) -> list[Sample]:
        """Every completion the qwen3 template sampled, in answer order (the toy templates log none)."""
        return self.app.samples

    @property
    def faults(self) -> int:
        """Scripted faults answered (error statuses and hangs)."""
        return self.app.faults

    async def _start(self, host: str, port: int) -> None:
        await asyncio.to_thread(self.app.load_model)  # the qwen3 tokenizer loads off the loop, before serving
        sock = bind_listener(host, port)
        self._host, self._port = host, int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            http="auto",  # httptools when installed, else h11
            ws="none",
            lifespan="off",
            log_config=None,  # logging is the embedding program's business
            access_log=False,
            server_header=False,
            date_header=False,
            proxy_headers=False,  # nobody proxies a test double: no X-Forwarded-* rewrite on every request
            backlog=LISTEN_BACKLOG,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._uvicorn = _Uvicorn(config)
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]), name=f"scripted-policy:{self._port}")
        listening = asyncio.ensure_future(self._uvicorn.listening.wait())
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.wait({self._task, listening}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            self._task.cancel()
            sock.close()
            raise
        finally:
            listening.cancel()
        if self._task.done():
            sock.close()
            self._task.result()  # raises what stopped it
            raise RuntimeError("the scripted server stopped while starting")

    @property
    def port(self) -> int:
        """The bound TCP port."""
        if self._task is None or self._task.done():
            raise RuntimeError("the scripted server is not listening")
        return self._port

    @property
    def url(self) -> str:
        """The OpenAI base URL, http://HOST:PORT/v1."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self._host, self._host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/v1"

    async def close(self) -> None:
        """Stop listening, answer waiting requests (latency, hangs) with 503, and close every connection."""
        if self._uvicorn is None or self._task is None:
            return
        self.app.close()
        self._uvicorn.stop.set()
        await self._task

    async def __aenter__(self) -> ScriptedServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_scripted_server(
    script: Script, host: str = "127.0.0.1", port: int = 0, *, tokens: bool = True
) -> ScriptedServer:
    """Start serving script on host:port (0: any free port); tokens=False never returns token ids or logprobs."""
    server = ScriptedServer(script, tokens=tokens)
    await server._start(host, port)
    return server


async def _serve(args: argparse.Namespace, script: Script) -> None:
    server = await start_scripted_server(script, args.host, args.port, tokens=not args.no_tokens)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: serve a script file until SIGTERM or SIGINT."""
    p = argparse.ArgumentParser(
        prog="python -m orchestrator.testing.scripted_policy", description="Serve a scripted OpenAI-compatible policy."
    )
    p.add_argument("--script", required=True, help="a Script as JSON")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--no-tokens", action="store_true", help="never return token ids or logprobs")
    p.add_argument(
        "--template", choices=get_args(Template), help="override the script's template (qwen3: the model server double)"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with open(args.script, encoding="utf-8") as f:
            script = Script.model_validate_json(f.read())
        if args.template:
            script = Script.model_validate({**script.model_dump(), "template": args.template})
    except (OSError, ValidationError) as e:
        print(f"error: cannot load script {args.script}: {e}", file=sys.stderr)
        return 2
    asyncio.run(_serve(args, script))
    return 0


if __name__ == "__main__":
    sys.exit(main())
