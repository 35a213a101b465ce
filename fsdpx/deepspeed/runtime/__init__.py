"""`deepspeed.runtime`: the submodule paths DeepSpeed scripts import from."""
