"""The global RNG state in Lightning checkpoints, set back where the resumed run needs it.

Shuffling and dropout draw from torch's global RNG, which Lightning's checkpoints do not hold.
:class:`ResumesRNG` adds it to the checkpoint, and the resumed run sets it back just before
the next epoch draws its shuffle, so ``trainer.fit(..., ckpt_path=...)`` from an epoch's end
continues as the run that wrote the checkpoint. Lightning (2.6) draws that shuffle at one of
two points:
- After a checkpoint written in ``on_train_epoch_end`` (``ModelCheckpoint``'s default), the
  resumed fit starts the next epoch, and its data loader draws the shuffle when the loop sets
  up its data, before any epoch hook: the state is set when the checkpoint is loaded.
- After a checkpoint written in the validation that follows an epoch's last batch
  (``ModelCheckpoint`` with ``check_val_every_n_epoch > 1`` saves there), Lightning re-enters
  that epoch, and setting up its data draws a shuffle the first run never drew. The state is
  then set in the next epoch's ``on_train_epoch_start``, before that epoch's loader draws.
A checkpoint written inside an epoch (``every_n_train_steps``) sets the state when loaded.
Only ``trainer.fit`` sets it: loading the checkpoint to test, predict or into
``load_from_checkpoint`` leaves the global RNG alone, as for a plain ``LightningModule``.

No import of lightning here: the mixin reads ``self.trainer`` as the module it is mixed into
has it, so the module that needs lightning stays ``vmapens.lightning``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ResumesRNG"]


class ResumesRNG:
    """Checkpoint hooks of a ``LightningModule``: save the global RNG state, and set it back
    where the resumed run draws its next shuffle (the module docstring says where)."""

    trainer: Any
    current_epoch: int
    _resume_rng: tuple[int, dict[str, Any]] | None = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the global RNG state and whether the resumed run will re-enter this epoch."""
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        loop = self.trainer.fit_loop
        progress = loop.epoch_progress.current
        # All the epoch's batches run, and the loop has not yet counted the epoch processed:
        # the validation after its last batch.
        reenters = bool(loop.epoch_loop._num_ready_batches_reached()) and (
            progress.processed < progress.started
        )
        checkpoint["vmapens"] = {"rng": rng, "epoch": self.current_epoch, "reenters": reenters}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Set the saved RNG state now, or when the epoch after a re-entered one starts."""
        held = checkpoint.get("vmapens", {})
        # Only a resumed fit continues the run: `load_from_checkpoint` and `trainer.test(...,
        # ckpt_path=...)` leave the global RNG as a plain module leaves it.
        trainer = getattr(self, "_trainer", None)
        if held.get("rng") is None or trainer is None or trainer.state.fn != "fit":
            return
        if held.get("reenters"):
            self._resume_rng = (held["epoch"], held["rng"])
        else:
            self._resume_rng = None
            _set_rng(held["rng"])

    def on_train_epoch_start(self) -> None:
        """The RNG state of a re-entered epoch's checkpoint, before this epoch draws."""
        pending = self._resume_rng
        if pending is not None and self.current_epoch > pending[0]:
            self._resume_rng = None
            _set_rng(pending[1])

    def on_fit_end(self) -> None:
        """A fit that stopped before the next epoch leaves no state for a later fit to set."""
        self._resume_rng = None


def _set_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
