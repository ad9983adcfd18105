"""Entry point inside sandbox images: put envd's private dependencies on sys.path, then run envd.

Run as `python3 -S /opt/envfleet/envd/launch.py`: -S keeps the image's own site-packages out of envd, and the
sandbox's processes never see envd's path because it is not exported.

envd never speaks TLS (a unix socket; gRPC brings its own TLS code), so Python's ssl module is kept out: asyncio
imports it only if it can, and OpenSSL costs every sandbox about 2 MB of private memory.
"""

import os
import sys

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(_root, "site"), _root]
sys.modules["ssl"] = None  # type: ignore[assignment]  # `import ssl` now raises ImportError

from envd.__main__ import main  # noqa: E402

main()
