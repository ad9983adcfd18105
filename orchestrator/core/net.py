"""Address checks shared by the client and the server."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether a listen address only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
