"""deepspeed.moe: the MoE layer a DeepSpeed script imports (`from deepspeed.moe.layer import MoE`).

Only `layer` is provided; DeepSpeed's other moe submodules (`sharded_moe`, `experts`,
`utils`) are absent, not stubbed.
"""
