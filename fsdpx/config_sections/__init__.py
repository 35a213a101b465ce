"""The sections of fsdpx.Config, one module per concern (fsdpx/config.py assembles them and
re-exports every name: import them from fsdpx.config)."""
