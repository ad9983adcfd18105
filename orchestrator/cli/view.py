"""`envfleet view FILE.jsonl` (the trajectory viewer over a file of rollouts) and `envfleet serve`'s viewer flags."""

from __future__ import annotations

import argparse
import threading
import webbrowser
from pathlib import Path

from orchestrator.core.errors import ConfigError
from orchestrator.core.models import Rollout
from orchestrator.core.net import is_loopback
from orchestrator.testing import toy_tokenizer
from orchestrator.viewer.rollout_page import TokenDecoder

# The policy model names of the scripted policy (tests, demo): its token ids are the toy tokenizer's.
SCRIPTED_MODELS = {"scripted"}


def toy_decoder(rollout: Rollout) -> TokenDecoder | None:
    """Decode token ids with the toy tokenizer when the scripted policy made the rollout; else show the ids (the
    orchestrator does not know a real model's tokenizer)."""
    return toy_tokenizer.token_text if rollout.provenance.policy_model in SCRIPTED_MODELS else None


def add_ui_arguments(serve: argparse.ArgumentParser) -> None:
    """`serve --ui-port/--ui-host`."""
    serve.add_argument("--ui-port", type=int, default=-1, help="serve the trajectory viewer on this port; -1: off")
    serve.add_argument(
        "--ui-host", default="127.0.0.1", help="where the viewer listens (plain HTTP: loopback unless --insecure)"
    )


def ui_settings(args: argparse.Namespace) -> dict[str, object]:
    """The OrchestratorConfig fields of the viewer flags."""
    return {"ui_port": None if args.ui_port < 0 else args.ui_port, "ui_host": args.ui_host}


def _cmd_view(args: argparse.Namespace) -> int:
    from orchestrator.viewer import FileSource, start_viewer

    if not is_loopback(args.host) and not args.insecure:
        # plain HTTP and no tokens: every rollout of the file to anyone who reaches the port (serve --ui-host refuses
        # the same)
        raise ConfigError(
            f"refusing to serve on {args.host!r}: the viewer is plain HTTP without authentication; keep it on "
            "loopback (a remote browser through an SSH tunnel: ssh -L 8765:127.0.0.1:8765 HOST), or pass --insecure"
        )
    source = FileSource(Path(args.file))
    try:
        viewer = start_viewer(source, args.host, args.port, decoder_for=toy_decoder)
    except OSError as e:
        raise ConfigError(
            f"cannot listen on {args.host}:{args.port}: {e.strerror} (--port 0 picks a free one)"
        ) from None
    print(f"viewing {args.file} at {viewer.url}/ (Ctrl-C to stop)", flush=True)
    if args.open:
        webbrowser.open(viewer.url + "/")
    try:
        threading.Event().wait()
    finally:
        viewer.close()
    return 0


def add_view_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`envfleet view FILE.jsonl`."""
    view = sub.add_parser("view", help="browse a JSONL file of rollouts in the trajectory viewer (a local web page)")
    view.add_argument("file", help="rollouts, one per line (what `envfleet rollout` and `envfleet demo` write)")
    view.add_argument("--host", default="127.0.0.1", help="where to listen (no authentication: keep it loopback)")
    view.add_argument("--port", type=int, default=8765, help="0: a free port")
    view.add_argument("--open", action="store_true", help="open it in the default browser")
    view.add_argument(
        "--insecure", action="store_true", help="allow a --host off loopback (anyone reaching it reads every rollout)"
    )
    view.set_defaults(fn=_cmd_view)
