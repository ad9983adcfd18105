"""The trajectory viewer: a read-only web UI over jobs and rollouts, served by `envfleet serve --ui-port` (live, per
tenant) and by `envfleet view FILE.jsonl` (a file of rollouts). Server-rendered HTML, no script, no build step."""

from orchestrator.viewer.http import ViewerServer, start_viewer
from orchestrator.viewer.sources import FileSource, LiveSource, Source

__all__ = ["FileSource", "LiveSource", "Source", "ViewerServer", "start_viewer"]
