"""Checkpoints of the whole training state that resume bit for bit (built on orbax).

A checkpoint directory holds one sub-directory per saved step. Each step is written to a
temporary directory, sealed with a manifest of SHA-256 checksums and renamed into place,
so a crash mid-save leaves the previous steps usable, and a truncated or corrupted step
raises `CorruptCheckpointError` instead of returning garbage.
"""

from gossipjax.checkpoint._checkpoint import (
    CorruptCheckpointError, all_steps, foreign_files, latest_step, remove, restore, save)
from gossipjax.checkpoint._ranks import rank_directory

__all__ = (
    "CorruptCheckpointError",
    "all_steps",
    "foreign_files",
    "latest_step",
    "rank_directory",
    "remove",
    "restore",
    "save",
)
