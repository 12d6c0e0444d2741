"""meshrl.train."""
