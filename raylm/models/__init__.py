"""Models: what to build (loading), how to build and cut it, and what it learns."""

from raylm.models.torchvision_models import ensure_importable

# (before any transformers import: see ensure_importable)
ensure_importable()
