"""Preference pairs over a policy's own samples, labelled by the task's verifier (rm.pairs_from="policy").

  examples = training_examples(cfg, count)                 # distinct prompts of the training split only
  texts = sample_policy(cfg, mesh, model, tokenizer, examples, samples=K, key=key)   # [N][K] completions
  pairs = pairs_from_samples(examples, texts, is_correct=..., origin="policy sample")
  train, held_out = policy_pairs(cfg, mesh, model, tokenizer)   # all of it, for rl/rewards/rm_job.py

Why: a reward model trained on hand-made negatives (train/synthetic_pairs.py) ranks those well and is
gamed by the first strings RL finds that it never saw (docs/benchmarks.md, "RL against a learned
reward model"). The pairs here are what the policy RL starts from actually writes: K completions per
training prompt sampled at rl.temperature by the run's generation engine (rl/step/spec.make_generator,
as rollouts and evaluation call it), each labelled by the task's verifier; for each prompt, every
distinct verifier-right completion is paired as chosen with every distinct verifier-wrong one as
rejected (a prompt whose samples are all right or all wrong gives no pair). This is the comparison
data of InstructGPT (Ouyang et al. 2022, arXiv:2203.02155, section 3.5: comparisons among the SFT
policy's own samples for one prompt), with the verifier in the labeller's place.

Prompts come from the training side of the data.eval_fraction hash split only (the held-out side is
what eval/accuracy measures); one in HELD_OUT_EVERY of them is set aside for the reward model's own
held-out pairwise accuracy (training-split prompts it is not trained on).

Axis legend: N prompts, K samples per prompt.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from meshrl.train.preferences import Pair

PAIRS_FROM = ("synthetic", "policy", "policy+synthetic")  # rm.pairs_from
HELD_OUT_EVERY = 8  # prompt i with i % 8 == 7 gives the reward model's held-out (validation) pairs


def pairs_from_samples(examples: Sequence[dict], samples: Sequence[Sequence[str]], *,
                       is_correct: Callable[[str, dict], bool], origin: str = "policy sample") -> list[Pair]:
  """Pairs of each example's samples: chosen = a distinct verifier-right sample, rejected = a distinct
  verifier-wrong one of the same prompt (every such combination, in sample order); none for a prompt
  whose samples are all right or all wrong, or empty. `samples[i]` are example i's K texts; a pair is
  named "<origin>:<i>" in errors."""
  if len(samples) != len(examples):
    raise ValueError(f"{len(samples)} sample lists for {len(examples)} examples.")
  pairs = []
  for i, (example, texts) in enumerate(zip(examples, samples)):
    right, wrong = [], []
    for text in dict.fromkeys(texts):  # distinct, in order
      if not text.strip():
        continue
      (right if is_correct(text, example) else wrong).append(text)
    pairs.extend(Pair(example["prompt"], good, bad, 0.0, f"{origin}:{i}") for good in right for bad in wrong)
  return pairs


def training_examples(cfg, count: int, *, seed: int | None = None) -> list[dict]:
  """`count` examples with distinct prompts from the training side of the training mixture's hash
  split (never a held-out prompt; fewer when the split has fewer): data.tasks, the data.jsonl /
  data.array_record rows and the multi-turn families data.tasks names (rl/step/sources.task_mixture)."""
  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs.mixture import distinct_examples
  from meshrl.rl.step.sources import task_mixture
  return distinct_examples(task_mixture(cfg, split="train", seed=cfg.seed if seed is None else seed), count)


def sample_policy(cfg, mesh, model, tokenizer, examples: Sequence[dict], *, samples: int,
                  key: jax.Array, temperature: float | None = None) -> list[list[str]]:
  """[N][K] completions of `model` (an nnx Transformer on `mesh`) for `examples`, K = `samples` each,
  at `temperature` (default rl.temperature) through the run's generation engine, in batches of
  eval.batch_size prompts (the last padded with its own last prompt; the padding's samples dropped)."""
  # pylint: disable=import-outside-toplevel
  from meshrl.rl.batches.rows import rollout_rows
  from meshrl.rl.step.groups import next_prompts, response_columns
  from meshrl.rl.step.spec import make_generator
  from meshrl.sharding.rules import data_parallel_size
  from meshrl.train.state import split_model
  _, params, extra = split_model(model)
  generate = make_generator(cfg, mesh, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id, group_size=samples,
                            temperature=temperature, multi_turn=False, complete=True)
  shards = data_parallel_size(mesh.shape) if mesh is not None else 1
  batch = -(-min(cfg.eval.batch_size, len(examples)) // shards) * shards
  texts: list[list[str]] = []
  for start in range(0, len(examples), batch):
    chunk = list(examples[start:start + batch])
    padded = chunk + [chunk[-1]] * (batch - len(chunk))
    prompts = next_prompts(iter(padded), tokenizer, count=batch, max_len=cfg.rl.max_prompt_len, overflow="truncate")
    out = generate(params, extra, prompts.tokens, prompts.mask, jax.random.fold_in(key, start))
    columns = response_columns(rollout_rows({"tokens": out.tokens, "response_mask": out.response_mask}),
                               cfg.rl.max_new_tokens)
    decoded = tokenizer.decode_batch(np.where(columns["response_mask"], columns["tokens"], tokenizer.pad_id))
    texts.extend(list(decoded[i * samples:(i + 1) * samples]) for i in range(len(chunk)))
  return texts


def sample_episodes(cfg, mesh, model, tokenizer, examples: Sequence[dict], *, samples: int, key: jax.Array,
                    temperature: float | None = None) -> tuple[list[list[str]], list[list[bool]]]:
  """A multi-turn run's (rl.multi_turn) samples: ([N][K] episodes of `model` for `examples` as text,
  everything after the prompt (its turns and the observations between them: what a multi-turn run's
  reward model reads, rl/step/episode_collect.scored_batch), [N][K] whether each was solved (its
  environment's reward > 0, as eval/accuracy counts)), K = `samples` each at `temperature` (default
  rl.temperature) through the run's episode runner and environments, eval.batch_size examples at a
  time (the last padded with its own last example; the padding's episodes dropped)."""
  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.spec import episode_runner
  from meshrl.train.state import split_model
  _, params, extra = split_model(model)
  runner = episode_runner(cfg, mesh, tokenizer, group_size=samples, temperature=temperature, complete=True)
  processes = jax.process_count()  # each host runs the environments of an equal block of rows
  batch = -(-min(cfg.eval.batch_size, len(examples)) // processes) * processes
  texts: list[list[str]] = []
  solved: list[list[bool]] = []
  try:
    for start in range(0, len(examples), batch):
      chunk = list(examples[start:start + batch])
      padded = chunk + [chunk[-1]] * (batch - len(chunk))
      out = runner.rollout(params, extra, padded, jax.random.fold_in(key, start))
      for i in range(len(chunk)):
        rows = slice(i * samples, (i + 1) * samples)
        texts.append(list(out.texts[rows]))
        solved.append([e.reward > 0 for e in out.episodes[rows]])
  finally:
    runner.close()
  return texts, solved


def labelled_samples(cfg, mesh, model, tokenizer, examples: Sequence[dict], *, samples: int, key: jax.Array,
                     temperature: float | None = None) -> tuple[list[list[str]], list[list[bool]]]:
  """([N][K] samples, [N][K] verifier-right): single-turn completions (`sample_policy`) graded by the
  task's verifier (answer_reward >= 1), or with rl.multi_turn whole episodes graded by their
  environments (`sample_episodes`)."""
  if cfg.rl.get("multi_turn", False):
    return sample_episodes(cfg, mesh, model, tokenizer, examples, samples=samples, key=key, temperature=temperature)
  from meshrl.rl.rewards import answer_reward  # pylint: disable=import-outside-toplevel
  texts = sample_policy(cfg, mesh, model, tokenizer, examples, samples=samples, key=key, temperature=temperature)
  return texts, [[answer_reward(t, e) >= 1.0 for t in ts] for e, ts in zip(examples, texts)]


def policy_temperatures(cfg) -> list[float]:
  """rm.policy_temperatures as numbers ("" = [rl.temperature])."""
  items = [t.strip() for t in str(cfg.rm.policy_temperatures).split(",") if t.strip()]
  return [float(t) for t in items] or [float(cfg.rl.temperature)]


def policy_pairs(cfg, mesh, model, tokenizer, *, report: Callable[[str], None] = print
                 ) -> tuple[list[Pair], list[Pair]]:
  """(training pairs, held-out pairs) over `model`'s samples (rm.policy_samples per prompt at each of
  rm.policy_temperatures) of
  rm.policy_prompts training-split prompts; held out: the prompts i % HELD_OUT_EVERY == 7 (training
  split, not trained on). ValueError naming rm.policy_prompts when a side has no pair."""
  examples = training_examples(cfg, cfg.rm.policy_prompts)
  texts, right = [[] for _ in examples], [[] for _ in examples]
  for i, temperature in enumerate(policy_temperatures(cfg)):
    more_texts, more_right = labelled_samples(cfg, mesh, model, tokenizer, examples, samples=cfg.rm.policy_samples,
                                              key=jax.random.key(cfg.seed + 3571 + i), temperature=temperature)
    for mine, mine_right, more, more_r in zip(texts, right, more_texts, more_right):
      mine.extend(more)
      mine_right.extend(more_r)
  # A sample's label by (prompt, text); a text sampled twice is right when either copy was.
  labels = {}
  for example, ts, rs in zip(examples, texts, right):
    for text, ok in zip(ts, rs):
      labels[(example["prompt"], text)] = labels.get((example["prompt"], text), False) or bool(ok)
  is_correct = lambda text, example: labels[(example["prompt"], text)]  # noqa: E731
  held = [i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(examples))]
  side = lambda keep: pairs_from_samples(  # noqa: E731
      [e for e, h in zip(examples, held) if h == keep], [t for t, h in zip(texts, held) if h == keep],
      is_correct=is_correct, origin="policy sample (held out)" if keep else "policy sample")
  train, held_out = side(False), side(True)
  share_right = np.mean([ok for rs in right for ok in rs])
  kind = "episodes" if cfg.rl.get("multi_turn", False) else "samples"
  report(f"policy pairs: {len(examples)} training-split prompts x {cfg.rm.policy_samples} {kind} at "
         f"T={','.join(map(str, policy_temperatures(cfg)))}, {share_right:.1%} verifier-right; {len(train)} training "
         f"pairs, {len(held_out)} held out")
  for pairs, name in ((train, "training"), (held_out, "held-out")):
    if not pairs:
      raise ValueError(f"rm.policy_prompts={cfg.rm.policy_prompts}: the warm-started policy's samples give no "
                       f"{name} pair (every prompt's {cfg.rm.policy_samples} samples all right or all wrong); "
                       "raise rm.policy_prompts or rm.policy_samples, or change rl.sft_steps / rl.temperature.")
  return train, held_out
