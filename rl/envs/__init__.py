"""meshrl.rl.envs."""
