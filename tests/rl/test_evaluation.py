"""Held-out evaluation: greedy accuracy over padded batches lines up with each example, per domain."""

import jax
import numpy as np

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.step.evaluation import Evaluator
from meshrl.rl.step.spec import make_generator
from meshrl.sharding import make_mesh
from meshrl.train.state import split_model

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "moe.expert_mlp_dim=32",
         "rl.max_prompt_len=8", "rl.max_new_tokens=4", "model.max_seq_len=16", "eval.batch_size=8",
         "eval.pass_k=3", "model.init_std=0.5"]


def test_greedy_accuracy_scores_each_example_through_padded_batches(devices):
  cfg = configs.load("configs/tiny.py", SMALL)
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0)
  _, params, extra = split_model(model)
  prompts = [f"{a}+{b}=" for a, b in zip(range(13), range(5, 18))]  # 13: one full batch of 8 + 5
  # What the model answers greedily, from a separate rollout of one prompt at a time.
  greedy = make_generator(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, group_size=8,
                        temperature=0.0)
  answers = []
  for prompt in prompts:
    tokens, mask = TOK.encode_batch([prompt], length=8)
    out = greedy(params, extra, tokens, mask, jax.random.key(0))
    answers.append(TOK.decode(np.where(out.response_mask[0], out.tokens[0], TOK.pad_id)[8:]))
  assert len(set(answers)) > 1
  domains = ["a" if i % 3 else "b" for i in range(13)]
  right = [{"prompt": p, "answer": a, "verifier": "exact", "domain": d}
           for p, a, d in zip(prompts, answers, domains)]
  half = [dict(e, answer=e["answer"] + "x") if e["domain"] == "b" else e for e in right]
  evaluator = Evaluator(cfg, mesh, TOK, right)
  metrics = evaluator(params, extra)
  assert metrics["eval/accuracy"] == 1.0 and metrics["eval/num_prompts"] == 13
  assert 0.0 <= metrics["eval/pass@3"] <= 1.0
  evaluator.examples = half
  metrics = evaluator(params, extra)
  assert metrics["eval/accuracy/a"] == 1.0 and metrics["eval/accuracy/b"] == 0.0
  np.testing.assert_allclose(metrics["eval/accuracy"], 8 / 13)
