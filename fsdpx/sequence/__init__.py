"""`fsdpx.sequence`: long sequences. Ulysses sequence parallelism and ring attention over
mesh.sp, batch sharding with pre-shifted labels, globally normalised and tiled losses,
tiled MLP.

Example (your own loop, a Hugging Face causal LM, mesh.sp = 4)::

    shard = fsdpx.sequence.shard_batch({"input_ids": ids, "labels": ids}, engine)
    loss = engine(**shard).loss          # this rank's share of the sequence's mean loss
    engine.backward(loss)
    engine.step()
"""

from fsdpx.sequence.batch import IGNORE_INDEX, shard_batch, shard_sequence
from fsdpx.sequence.loss import loss_fn, tiled_loss_fn
from fsdpx.sequence.ring import RingSDPA, ring_attention, ring_chunks
from fsdpx.sequence.tiled import tile_mlp_, tiled_apply
from fsdpx.sequence.ulysses import UlyssesSDPA, ulysses_attention

__all__ = [
    "IGNORE_INDEX",
    "RingSDPA",
    "UlyssesSDPA",
    "loss_fn",
    "ring_attention",
    "ring_chunks",
    "shard_batch",
    "shard_sequence",
    "tile_mlp_",
    "tiled_apply",
    "tiled_loss_fn",
    "ulysses_attention",
]
