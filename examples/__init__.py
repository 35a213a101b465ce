"""Example models and training scripts for fsdpx; each file reads top to bottom."""
