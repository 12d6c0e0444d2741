"""meshrl.rl."""
