"""meshrl.rl.rewards."""
