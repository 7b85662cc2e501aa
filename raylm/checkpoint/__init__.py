"""Checkpoints: atomic commit and rotation on disk, a rank's state to files and back, and the same form in Ray's object store."""
