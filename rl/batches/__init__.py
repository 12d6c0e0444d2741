"""The typed hand-overs between RL stages and the device-side movers of their rows: ScoredBatch / UpdateBatch, rows kept on the devices, MoE routes, packing and layouts."""
