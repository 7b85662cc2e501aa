"""Models: what to build (loading), how to build and cut it, and what it learns."""
