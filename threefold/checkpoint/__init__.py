"""Sharded, atomic, verified checkpoints that load into any layout."""

from threefold.checkpoint.io import find_resumable, load_into, open_checkpoint, save, save_whole
from threefold.checkpoint.manifest import CheckpointError, Manifest, list_checkpoints, verify
from threefold.checkpoint.resume import choose
from threefold.checkpoint.state import LocalTensor, model_tensors, training_state

__all__ = [
    "choose",
    "find_resumable",
    "load_into",
    "open_checkpoint",
    "save",
    "save_whole",
    "CheckpointError",
    "Manifest",
    "list_checkpoints",
    "verify",
    "LocalTensor",
    "model_tensors",
    "training_state",
]
