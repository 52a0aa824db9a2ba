"""The weight store's error, apart from its torch-importing modules: a stage names it among its
start errors before it imports torch."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as one: the message names the file."""
