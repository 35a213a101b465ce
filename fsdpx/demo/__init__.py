"""The demo's model and training, shipped with the package so that `fsdpx demo` runs from a
pip install (not only from a source checkout).

    gpt     a small byte-level GPT and a download-free corpus (the Python standard
            library's source); the tests' reference model too
    train   the example training loop: `python -m fsdpx.demo.train`, or under torchrun
            `torchrun --standalone --nproc_per_node=2 -m fsdpx.demo.train`

This package file imports nothing (importing `fsdpx.demo` must not load torch).
"""
