"""`fsdpx launch`: start a job on one or many hosts the way DeepSpeed users do (hostfile,
``--include``/``--exclude``, ssh or SLURM), with torchrun agents doing the work.

Modules: `hosts` (hostfile and resource filters), `commands` (the per-host torchrun
commands for each launcher), `runner` (start, relay output, stop every node when one
fails), `cli` (the arguments).
"""
