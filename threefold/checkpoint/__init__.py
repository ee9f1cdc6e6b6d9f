"""Sharded, atomic, verified checkpoints that load into any layout."""
from threefold.checkpoint.io import find_resumable, load_into, open_checkpoint, save
from threefold.checkpoint.manifest import CheckpointError, Manifest, list_checkpoints, verify
from threefold.checkpoint.state import LocalTensor, training_state

__all__ = ["find_resumable", "load_into", "open_checkpoint", "save", "CheckpointError", "Manifest",
           "list_checkpoints", "verify", "LocalTensor", "training_state"]
