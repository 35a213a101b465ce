"""What tests/dist.py's fork server imports once per pytest session, so that the ranks it
forks start with these modules loaded ([Note: ranks forked from a preloaded server]).

Only the server imports this module. An import that fails here (transformers absent, or a
broken fsdpx module while it is being edited) is skipped, so the server still starts; the
rank that needs the module imports it again and fails there with the real traceback.
multiprocessing's own preload list skips ImportError only: any other error (a SyntaxError)
would stop the server and with it every multi-rank test.
"""

from __future__ import annotations

import contextlib
import importlib

MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "fsdpx",
    "fsdpx.engine",
    "fsdpx.demo.gpt",
    # The Hugging Face tests' ranks (the `fsdpx[hf]` extra). Named modules, not
    # transformers' lazy attributes, so the code itself is loaded.
    "transformers.models.llama.modeling_llama",
    "transformers.trainer",
    "tests.dist",
)

for _name in MODULES:
    with contextlib.suppress(Exception):
        importlib.import_module(_name)
