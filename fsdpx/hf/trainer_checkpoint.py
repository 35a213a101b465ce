"""The checkpoint side of `fsdpx.hf.Trainer`: what goes into the Trainer's checkpoint-N
folders and how a run resumes from them ([Note: Trainer on fsdpx] in fsdpx/hf/trainer.py).

[Note: weights once per checkpoint] The weights are stored once per checkpoint-N, in the
fsdpx checkpoint: it must hold them anyway (it is what resumes, bitwise, at any world
size, with its masters and their optimizer state), and a second Hugging Face copy doubled
every save's bytes and added a gather of the whole model to rank 0 per save. The Hugging
Face layout of any checkpoint-N is one offline command away (`fsdpx-ckpt consolidate
checkpoint-N/fsdpx OUT --hf-config checkpoint-N`); `save_model()` called by the user, and
`save_only_model=True` checkpoints (no fsdpx state), write Hugging Face layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsdpx.checkpoint.state import rng_state, set_rng_state
from fsdpx.engine import Engine

__all__ = ["FSDPX_DIR", "CheckpointMixin"]

FSDPX_DIR = "fsdpx"
"""The fsdpx checkpoint's folder inside the Trainer's checkpoint-N folder."""


class CheckpointMixin:
    """transformers.Trainer's save / load hooks, on the engine's checkpoint."""

    # Set by transformers.Trainer and fsdpx.hf.Trainer.
    engine: Engine | None
    args: Any
    state: Any
    model: Any
    processing_class: Any
    _rng_after_load: dict[str, Any] | None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model in Hugging Face layout (every rank takes part; rank 0 writes). In a
        checkpoint-N the weights are in the fsdpx checkpoint only ([Note: weights once per
        checkpoint]): the Trainer's own call writes the config files there."""
        out = str(output_dir if output_dir is not None else self.args.output_dir)
        if _internal_call and self.engine is not None and not self.args.save_only_model:
            if self.args.should_save:
                self._save_model_files(out)
        elif self.engine is not None:
            self.engine.save_pretrained(out)
        elif self.args.should_save:
            self.model.save_pretrained(out)
        if self.processing_class is not None and self.args.should_save:
            self.processing_class.save_pretrained(out)

    def _save_model_files(self, out: str) -> None:
        """What Hugging Face layout holds beside the weights: config, generation config."""
        model = self.model
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(out)
        can_generate = getattr(model, "can_generate", None)
        generation = getattr(model, "generation_config", None)
        if generation is not None and callable(can_generate) and can_generate():
            generation.save_pretrained(out)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        assert best is not None
        folder = Path(best) / FSDPX_DIR
        if not folder.is_dir():
            raise ValueError(
                f"load_best_model_at_end: {best} has no fsdpx checkpoint ({FSDPX_DIR}/); "
                "fsdpx.hf.Trainer loads the best model from it, so save_only_model=True cannot "
                "be combined with load_best_model_at_end"
            )
        assert self.engine is not None
        self.engine.load_checkpoint(folder, load_module_only=True)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        assert self.engine is not None
        args = json.loads(self.args.to_json_string())
        self.engine.save_checkpoint(
            Path(output_dir) / FSDPX_DIR, client_state={"training_args": args}
        )

    def _save_scaler(self, output_dir: str) -> None:
        return None  # the loss scaler is in the fsdpx checkpoint

    def _save_rng_state(self, output_dir: str) -> None:
        return None  # every rank's RNG states are in the fsdpx checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        return None  # the fsdpx checkpoint restores the model once it is sharded

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        assert self.engine is not None
        folder = Path(checkpoint) / FSDPX_DIR
        # A checkpoint-N without fsdpx state: load_checkpoint names what is there
        # (DeepSpeed's folders raise its DeepSpeedCheckpointError).
        self.engine.load_checkpoint(folder if folder.is_dir() else checkpoint)
        self._rng_after_load = rng_state()

    def _load_scaler(self, checkpoint: str | None) -> None:
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # The Trainer restores RNG after skipping the batches already trained on.
        if checkpoint is not None and self._rng_after_load is not None:
            set_rng_state(self._rng_after_load)
