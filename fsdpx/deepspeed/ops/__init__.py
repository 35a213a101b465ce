"""`deepspeed.ops`: the optimizer classes DeepSpeed scripts import (`ops.adam`, `ops.lamb`)."""
