"""Checkpoints: ``smp.save`` / ``smp.load`` of single objects (files), training checkpoints
(``save_checkpoint`` / ``resume_from_checkpoint``, training) and their sharded files on
torch.distributed.checkpoint (dcp)."""

from smp.checkpoints.training import CheckpointError, resume_from_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "resume_from_checkpoint", "save_checkpoint"]
