"""The monitor's widgets, one per module."""
