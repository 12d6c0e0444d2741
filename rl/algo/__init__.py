"""The RL algorithm as functions of arrays: advantage estimators, losses, the jitted update, draft distillation."""
