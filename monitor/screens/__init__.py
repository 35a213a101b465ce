"""The monitor's screens besides the main one."""
