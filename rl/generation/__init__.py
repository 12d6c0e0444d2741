"""The one generation engine: every token meshrl generates (RL rollouts, agent episodes, evaluation, the
server, draft distillation, the int8 quality report, the AOT decode programs) goes through its decode
core. Imports only `meshrl.model` and `meshrl.sharding`. See docs/generation.md."""
