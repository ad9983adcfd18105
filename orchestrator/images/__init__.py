"""Offline image pipeline: rootfs (debootstrap) -> base (envd) -> environment images, each cached by an input hash."""

from orchestrator.images.base import ensure_base_image
from orchestrator.images.build import build_image
from orchestrator.images.spec import build_from_spec

__all__ = ["build_from_spec", "build_image", "ensure_base_image"]
