"""meshrl.model."""
