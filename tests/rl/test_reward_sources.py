"""Reward sources per domain (rl/rewards/sources.py): a reward model and a generative judge scoring
beside the policy, mixed with verifiers by domain.

Claims and the bugs they catch:
- the RM rewards a step trains on equal the RM scored alone on one device over the same completions,
  and reach the advantages as a verifier's reward does (a dropped row, rows scored in another order,
  the padding row's score kept, the wrong encoding of prompt + response, advantages from other rewards);
- each sample gets its own domain's source, a mixed domain its weighted sum (a swapped mapping, the
  default used for a named domain, a weight dropped);
- the judge's verdicts are the generation engine's greedy decode, parsed robustly; malformed ones score
  0 and are counted (a guessed number, a scale ignored, errors not counted);
- bad input (an unknown source, a missing checkpoint folder, another tokenizer, a rubric without a
  score format, a checkpoint no domain uses) is one line naming the field before anything is written.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.algo.advantages import grpo
from meshrl.rl.rewards import answer_reward
from meshrl.rl.rewards.judge import Judge, Rubric, parse_verdict, read_rubric, read_rubrics
from meshrl.rl.rewards.pool import RewardPool
from meshrl.rl.rewards.rm_scorer import length_guard
from meshrl.rl.rewards.sources import (SourcedRewards, check_reward_sources, normalize_per_domain, parse_sources,
                                       reward_pool)
from meshrl.rl.step import driver as loop
from meshrl.rl.step.program import collect, prepare
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.preferences import encode_side
from meshrl.train.reward_model import make_scorer
from meshrl.train.rm_source import load_judge_model
from meshrl.train.state import TrainState

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=32",
         "rl.prompts_per_step=4", "rl.group_size=4", "rl.sft_steps=0", "rl.dynamic_sampling=false",
         "rl.temperature=1.0", "model.init_std=0.3", "log.progress_bar=false", "log.tensorboard=false",
         "log.plot=false"]
RUBRIC = "Grade 0-10, reply 'Score: N'. Q: {prompt} A: {response}"


def _cfg(*extra):
  return configs.load("configs/tiny.py", SMALL + list(extra))


def _save_model(folder, *overrides, seed=1) -> str:
  """A meshrl checkpoint of a random model of SMALL's shape with `overrides` (its saved config too)."""
  cfg = _cfg(*overrides)
  model = build_model(ModelConfig.from_config(cfg), None, seed=seed)
  _, params, extra = nnx.split(model, nnx.Param, ...)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state={}, extra=extra)
  with Checkpointer(os.path.join(folder, "checkpoints"), async_save=False) as ckpt:
    ckpt.save(1, state, config=cfg, force=True)
  return str(folder)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
  return _save_model(tmp_path_factory.mktemp("rm"), "model.value_head=true", "model.init_std=0.5")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
  return _save_model(tmp_path_factory.mktemp("judge"), seed=3)


@pytest.fixture(scope="module")
def rubric(tmp_path_factory):
  path = tmp_path_factory.mktemp("rubric") / "rubric.txt"
  path.write_text(RUBRIC)
  return str(path)


# --- the spec, the verdicts, the guards (no model) ----------------------------------------------------


def test_sources_parse_per_domain_with_a_default():
  sources = parse_sources("chat=reward_model;writing=judge:0.5,verifier:0.5;*=judge")
  assert sources.of("chat") == (("reward_model", 1.0),)
  assert sources.of("writing") == (("judge", 0.5), ("verifier", 0.5))
  assert sources.of("math") == (("judge", 1.0),)
  assert parse_sources("").of("anything") == (("verifier", 1.0),)
  assert parse_sources("chat=reward_model").of("math") == (("verifier", 1.0),)


@pytest.mark.parametrize("spec, message", [
    ("chat=oracle", "source 'oracle' of domain 'chat' is unknown; choose from verifier, reward_model, judge"),
    ("chat", "item 'chat' must be 'domain=source:weight,...'"),
    ("chat=judge;chat=verifier", "names domain 'chat' twice"),
    ("chat=judge:0", "weight 0.0 of 'judge' of domain 'chat' must be positive"),
    ("chat=judge:x", "weight 'x' of 'judge' is not a number"),
])
def test_malformed_sources_are_one_line_errors(spec, message):
  with pytest.raises(ValueError) as error:
    parse_sources(spec)
  assert message in str(error.value) and "rl.reward_sources" in str(error.value)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("verdict, score", [
    ("Score: 7", 0.7), ("The answer is right.\nScore: 10", 1.0), ("**Score:** 8/10", 0.8),
    ("score = 3.5", 0.35), ("SCORE:0", 0.0), ("Score: 6. Score: 2", 0.6),
    ("", None), ("I like it", None), ("Score: 11", None), ("Score: -1", None), ("Score: 4/5", None),
    ("Score: high", None), ("10", None),
])
def test_verdicts_parse_or_are_malformed(verdict, score):
  assert parse_verdict(verdict, 10) == (None if score is None else pytest.approx(score))


def test_rubric_needs_placeholders_and_a_score_format(tmp_path):
  for text, message in [("Rate {prompt}: Score: N", "lacks {response}"),
                        ("Rate {prompt} answered {response} from 0 to 10.", "has no score format"),
                        (RUBRIC, None)]:
    path = tmp_path / "r.txt"
    path.write_text(text)
    if message is None:
      assert read_rubric(str(path)).render("p", "r") == RUBRIC.replace("{prompt}", "p").replace("{response}", "r")
      continue
    with pytest.raises(ValueError, match=f"rl.judge_rubrics: rubric '{path}' {message}"):
      read_rubric(str(path))
  with pytest.raises(ValueError, match="rubric file '/nope.txt' does not exist"):
    read_rubrics("*=/nope.txt")


def test_length_guard():
  scores, lengths = np.array([2.0, 2.0, -1.0]), np.array([1, 4, 0])
  np.testing.assert_allclose(length_guard(scores, lengths), scores)
  np.testing.assert_allclose(length_guard(scores, lengths, normalize=True), [2.0, 0.5, -1.0])
  np.testing.assert_allclose(length_guard(scores, lengths, penalty=0.25), [1.75, 1.0, -1.0])
  np.testing.assert_allclose(length_guard(scores, lengths, penalty=0.25, normalize=True), [1.75, -0.5, -1.0])


class _Planted:
  """A batch scorer that returns planted scores by completion text (checks the mixing alone)."""

  def __init__(self, table, errors=0):
    self.table, self.errors, self.calls = table, errors, []

  def dispatch(self, completions, examples):
    del examples
    self.calls.append(list(completions))
    return list(completions)

  def finish(self, completions):
    return (np.asarray([self.table[c] for c in completions], np.float32),
            {"errors": self.errors, "first_errors": ["planted"] * self.errors})


def test_each_sample_gets_its_own_domains_sources():
  completions = ["19", "7", "cba", "abc", "x"]
  examples = [{"prompt": "12+7", "answer": "19", "domain": "math"}, {"prompt": "3+3", "answer": "6", "domain": "math"},
              {"prompt": "rev abc", "answer": "cba", "domain": "chat"},
              {"prompt": "rev abc", "answer": "cba", "domain": "mixed"}, {"prompt": "q", "answer": "x", "domain": "other"}]
  rm = _Planted({"cba": 0.25, "abc": -2.0, "x": 5.0})
  judge = _Planted({"abc": 0.5}, errors=1)
  pool = RewardPool(answer_reward, num_workers=2, timeout_s=5.0)
  scorer = SourcedRewards(pool, parse_sources("chat=reward_model;mixed=judge:2,verifier:0.5;*=verifier"),
                          {"reward_model": rm, "judge": judge})
  rewards, info = scorer.score(completions, examples)
  # math: the verifier (1, 0); chat: the RM (0.25); mixed: 2 * judge + 0.5 * verifier("abc" vs "cba" = 0);
  # other: the default, the verifier (1): not the RM's planted 5.
  np.testing.assert_allclose(rewards, [1.0, 0.0, 0.25, 1.0, 1.0])
  assert rm.calls == [["cba"]] and judge.calls == [["abc"]]  # each model only on its own domains' samples
  assert info["reward_errors"] == 1 and info["first_errors"] == ["judge: planted"]
  assert info["by_domain"]["math"] == pytest.approx(0.5)
  swapped = SourcedRewards(pool, parse_sources("mixed=reward_model;chat=judge:2,verifier:0.5;*=verifier"),
                           {"reward_model": rm, "judge": _Planted({"cba": 0.5})})
  assert not np.allclose(swapped.score(completions, examples)[0], rewards)
  scorer.close()


def test_model_sources_score_while_the_verifier_threads_run():
  """A batch whose verifier takes 0.4 s and whose reward model takes 0.4 s is scored in well under
  0.8 s: the verifier's samples are queued on the pool's threads before the model scores (a pool
  collected before the model runs, or submitted after, would take the sum)."""
  import time  # pylint: disable=import-outside-toplevel

  def slow_verifier(completion, example):
    time.sleep(0.4)
    return 1.0

  class SlowModel(_Planted):
    def finish(self, completions):
      time.sleep(0.4)  # the devices' scoring, read back
      return super().finish(completions)

  pool = RewardPool(slow_verifier, num_workers=2, timeout_s=5.0)
  scorer = SourcedRewards(pool, parse_sources("chat=reward_model"), {"reward_model": SlowModel({"b": 3.0})})
  start = time.perf_counter()
  rewards, _ = scorer.score(["a", "b"], [{"prompt": "p", "domain": "math"}, {"prompt": "p", "domain": "chat"}])
  elapsed = time.perf_counter() - start
  np.testing.assert_allclose(rewards, [1.0, 3.0])
  assert elapsed < 0.7, elapsed
  scorer.close()


def test_rewards_normalised_per_domain():
  """rl.reward_norm=domain: each domain's rewards whitened over its own samples (unbiased std), so a
  reward model's logits and a verifier's 0/1 weigh alike; a one-sample domain gets 0."""
  rewards = np.array([1.0, 0.0, 1.0, 4.0, -2.0, 7.0, 3.0], np.float32)
  domains = ["v", "v", "v", "rm", "rm", "rm", "lone"]
  got = normalize_per_domain(rewards, domains)
  for d in set(domains):
    rows = np.asarray([x == d for x in domains])
    values = rewards[rows]
    std = values.std(ddof=1) if len(values) > 1 else 0.0
    np.testing.assert_allclose(got[rows], (values - values.mean()) / (std + 1e-6), rtol=1e-5)
  assert got[-1] == 0.0 and abs(got[:3].mean()) < 1e-6 and abs(got[3:6].std(ddof=1) - 1.0) < 1e-4
  cfg = _cfg("rl.reward_norm=domain", "data.tasks=reverse:1.0")
  pool = reward_pool(cfg, None, TOK)  # verifier only, normalised: a SourcedRewards without models
  examples = [{"prompt": "rev ab", "answer": "ba", "domain": "a"}] * 3 + [{"prompt": "rev c", "answer": "c", "domain": "b"}] * 2
  scored, _ = pool.score(["ba", "ab", "ba", "c", "x"], examples)
  np.testing.assert_allclose(scored, normalize_per_domain(np.array([1, 0, 1, 1, 0], np.float32), [e["domain"] for e in examples]))
  pool.close()
  plain = reward_pool(_cfg(), None, TOK)
  assert isinstance(plain, RewardPool)  # the default: the plain pool, unchanged
  plain.close()


def test_judge_parses_planted_verdicts_and_counts_malformed_ones():
  class PlantedJudge(Judge):
    def __init__(self, verdicts):  # pylint: disable=super-init-not-called  (no model: planted verdicts)
      self.tokenizer, self.rubrics, self.max_score, self.prompt_len = TOK, {"*": read_rubric_text()}, 10.0, 64
      self.planted = verdicts

    def _launch(self, texts):  # the decoding the devices would start: here, the planted verdicts
      assert len(texts) == len(self.planted)
      return list(self.planted)

    def _read(self, calls):
      return calls

  def read_rubric_text():
    return Rubric(RUBRIC, "planted")

  judge = PlantedJudge(["Score: 9", "no idea", "Score: 12", "**Score:** 3/10"])
  scores, info = judge(["a", "b", "c", "d"], [{"prompt": "p", "domain": "x"}] * 4)
  np.testing.assert_allclose(scores, [0.9, 0.0, 0.0, 0.3])
  assert info["judge_malformed"] == info["errors"] == 2
  assert info["first_errors"] == ["judge[1]: malformed verdict 'no idea'", "judge[2]: malformed verdict 'Score: 12'"]


# --- bad input: one line, before anything is written --------------------------------------------------


def test_missing_checkpoint_folder_stops_the_run_before_it_writes(tmp_path):
  workdir = tmp_path / "run"
  cfg = _cfg("rl.reward_sources=*=reward_model", f"rl.reward_model_checkpoint={tmp_path / 'nope'}")
  with pytest.raises(ValueError) as error:
    loop.run(cfg, str(workdir))
  assert str(error.value) == f"rl.reward_model_checkpoint='{tmp_path / 'nope'}' does not exist."
  assert not workdir.exists()


def test_sources_checked_against_their_checkpoints(tmp_path, rm_dir, judge_dir, rubric, hf_fixtures):
  def refused(message, *overrides):
    with pytest.raises(ValueError) as error:
      check_reward_sources(_cfg(*overrides))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)

  refused("uses 'reward_model': set rl.reward_model_checkpoint", "rl.reward_sources=chat=reward_model")
  refused(f"rl.reward_model_checkpoint='{rm_dir}' is set but no domain of rl.reward_sources='' (or of data.domains) "
          "uses 'reward_model'",
          f"rl.reward_model_checkpoint={rm_dir}")
  refused(f"rl.reward_model_checkpoint='{judge_dir}' was saved with model.value_head=False",
          "rl.reward_sources=*=reward_model", f"rl.reward_model_checkpoint={judge_dir}")
  hf_fixtures.save_tokenizer(str(tmp_path / "tok"))
  refused(f"rl.reward_model_checkpoint='{rm_dir}': the reward model's tokenizer 'byte' differs from the policy's "
          f"model.tokenizer='{tmp_path / 'tok' / 'tokenizer.json'}'",
          "rl.reward_sources=*=reward_model", f"rl.reward_model_checkpoint={rm_dir}",
          f"model.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}", "model.vocab_size=512")
  refused("rl.judge_rubrics='' names no rubric", "rl.reward_sources=*=judge", f"rl.judge_checkpoint={judge_dir}")
  refused("exceeds the judge's model.max_seq_len=32", "rl.reward_sources=*=judge", f"rl.judge_checkpoint={judge_dir}",
          f"rl.judge_rubrics=*={rubric}")
  check_reward_sources(_cfg("rl.reward_sources=a=reward_model;b=judge", f"rl.reward_model_checkpoint={rm_dir}",
                            f"rl.judge_checkpoint={judge_dir}", f"rl.judge_rubrics=*={rubric}",
                            "rl.judge_prompt_len=24", "rl.judge_max_tokens=8"))


class _Spy:
  """The run's scorer, recording what it was asked to score."""

  def __init__(self, pool):
    self.pool, self.seen = pool, []

  def submit(self, completions, examples):
    self.seen.append((list(completions), list(examples)))
    return self.pool.submit(completions, examples)

  def collect(self, pending):
    return self.pool.collect(pending)

  def close(self):
    self.pool.close()


def test_registry_domains_name_their_sources(tmp_path, rm_dir):
  """A data.domains domain's "sources" field gives that domain its sources; a bad one is refused naming
  the file and line; naming a domain's sources in both places is refused."""
  from meshrl.rl.rewards.sources import domain_sources  # pylint: disable=import-outside-toplevel
  path = tmp_path / "domains.jsonl"
  rows = [{"name": "rev", "source": "generator:reverse", "reward": "exact", "weight": 1.0,
           "sources": "reward_model:2,verifier"},
          {"name": "math", "source": "generator:arithmetic", "reward": "numeric", "weight": 1.0}]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  cfg = _cfg(f"data.domains={path}", f"rl.reward_model_checkpoint={rm_dir}")
  sources = domain_sources(cfg)
  assert sources.of("rev") == (("reward_model", 2.0), ("verifier", 1.0)) and sources.of("math") == (("verifier", 1.0),)
  check_reward_sources(cfg)  # the registry's reward_model domain uses the checkpoint
  with pytest.raises(ValueError, match="both give domain 'rev' its sources; keep one"):
    domain_sources(_cfg(f"data.domains={path}", "rl.reward_sources=rev=judge"))
  rows[1]["sources"] = "oracle"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  with pytest.raises(ValueError) as error:
    domain_sources(cfg)
  assert str(error.value).startswith(f"{path}:2: domain 'math': field 'sources': source 'oracle' is unknown")


# --- on the mesh ------------------------------------------------------------------------------------


def test_rm_rewards_in_the_step_equal_the_rm_scored_alone(devices, rm_dir):
  """Two domains: reverse scored by the reward model (on the run's fsdp=4 x tensor=2 mesh, batched),
  arithmetic by its verifier. Each sample's reward is its own domain's, the RM's equal the RM scored
  alone on one device over the same completions, and the advantages are GRPO of these rewards."""
  del devices
  cfg = _cfg("mesh.fsdp=4", "mesh.tensor=2", "data.tasks=reverse:1.0,arithmetic:1.0",
             "rl.reward_sources=reverse=reward_model", f"rl.reward_model_checkpoint={rm_dir}")
  run, prompts = loop.setup(cfg)
  run.pool.close()
  run.pool = _Spy(reward_pool(cfg, run.mesh, TOK))  # the hook build_run should call (see the issue 35 report)
  scored, metrics = collect(run, prompts, jax.random.key(0))
  [(texts, examples)] = run.pool.seen  # one round (no dynamic sampling): the batch's samples in order
  assert texts == scored.texts
  domains = scored.domains
  assert {"reverse", "arithmetic"} <= set(domains), domains

  # The RM alone, one device, over the same completions.
  from meshrl.train.rm_source import load_reward_model  # pylint: disable=import-outside-toplevel
  model, rm_cfg = load_reward_model(rm_dir, cfg, None)
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  row_len = cfg.rl.max_prompt_len + cfg.rl.max_new_tokens + 2
  prompts_text = [e["prompt"] for e in examples]
  full = [encode_side(TOK, p, t) for p, t in zip(prompts_text, scored.texts)]
  rows = [ids[-row_len:] for ids in full]  # a longer row keeps its last tokens
  tokens = np.zeros((len(rows), row_len), np.int32)
  for i, ids in enumerate(rows):
    tokens[i, :len(ids)] = ids
  alone = np.asarray(make_scorer(graphdef)(params, extra, tokens, np.asarray([len(r) for r in rows], np.int32)))
  verifier = np.asarray([answer_reward(t, e) for t, e in zip(scored.texts, examples)])
  is_rm = np.asarray([d == "reverse" for d in domains])
  np.testing.assert_allclose(scored.rewards[is_rm], alone[is_rm], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(scored.rewards[~is_rm], verifier[~is_rm])
  assert np.ptp(alone[is_rm]) > 1e-3  # the scores differ across samples: a row mix-up would show
  assert not np.allclose(alone[is_rm], verifier[is_rm])  # a swapped mapping would show
  # Each source's own figures in the step's metrics, per domain (its score beside the verifier's).
  assert metrics["score/reward_model/reverse"] == pytest.approx(float(alone[is_rm].mean()), abs=1e-5)
  assert metrics["score/verifier/arithmetic"] == pytest.approx(float(verifier[~is_rm].mean()))
  assert "score/reward_model/arithmetic" not in metrics and metrics["rm_truncated"] == sum(
      len(ids) > row_len for ids, d in zip(full, domains) if d == "reverse")

  batch, _ = prepare(run, scored)
  expected = np.asarray(grpo(jnp.asarray(scored.rewards), group_size=cfg.rl.group_size))
  got = np.asarray(jax.device_get(batch.advantages))
  mask = np.asarray(jax.device_get(batch.loss_mask)).astype(bool)
  np.testing.assert_allclose(got, np.where(mask, expected[:, None], 0.0), rtol=1e-5, atol=1e-5)
  run.close()


def test_judge_decodes_through_the_engine_as_plain_greedy_decoding(devices, judge_dir, rubric):
  """The judge's verdicts (a Generator on a 2-way fsdp mesh, batched) equal a plain greedy loop over the
  same model's full forward, prompt by prompt, without padding or cache."""
  del devices
  from meshrl.sharding.mesh import make_mesh  # pylint: disable=import-outside-toplevel
  cfg = _cfg("mesh.fsdp=2", "rl.reward_sources=*=judge", f"rl.judge_checkpoint={judge_dir}",
             f"rl.judge_rubrics=*={rubric}", "rl.judge_prompt_len=24", "rl.judge_max_tokens=5")
  mesh = make_mesh(cfg.mesh, devices=jax.devices()[:2])
  sourced = reward_pool(cfg, mesh, TOK)  # the run's builder: the judge loaded on the mesh, batched
  judge = sourced.scorers["judge"]
  assert judge.rows == 16 and judge.generator.spec.step.sampler.temperature == 0.0
  completions = ["cba", "a!", "xyz?"]  # 3 samples in a call of 16 rows: the padding rows are dropped
  examples = [{"prompt": "rev abc", "domain": "d"}, {"prompt": "1+1", "domain": "d"}, {"prompt": "q", "domain": "e"}]
  texts, _ = judge.prompts(completions, examples)
  verdicts = judge.verdicts(texts)
  print("verdicts:", verdicts)
  assert all(verdicts) and len(set(verdicts)) == 3  # the parity below is over distinct, non-empty verdicts
  reference = load_judge_model(judge_dir, cfg, None)[0]
  for text, verdict in zip(texts, verdicts):
    ids = TOK.encode(text)
    ids = ids if len(ids) <= 24 else ids[:1] + ids[len(ids) - 23:]  # as encode_batch truncates: BOS kept
    out = []
    for _ in range(5):
      logits = reference(jnp.asarray([ids + out])).logits[0, -1]
      token = int(jnp.argmax(logits))
      if token in TOK.stop_ids:
        break
      out.append(token)
    assert verdict == TOK.decode(out)
  scores, info = judge(completions, examples)
  assert info["judge_malformed"] == sum(parse_verdict(v, 10) is None for v in verdicts)
  np.testing.assert_allclose(scores, [parse_verdict(v, 10) or 0.0 for v in verdicts])
  sourced.close()


def test_held_out_rm_score_is_reported_beside_verifier_accuracy(devices, rm_dir):
  """eval/rm_score is the reward model's mean score of the greedy held-out completions (the ones
  eval/accuracy grades), per domain too: a policy that games the RM raises it and not the accuracy."""
  del devices
  from meshrl.rl.rewards.sources import reward_model_scorer  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.evaluation import Evaluator  # pylint: disable=import-outside-toplevel
  from meshrl.train.rm_source import load_reward_model  # pylint: disable=import-outside-toplevel
  cfg = _cfg("rl.reward_sources=*=reward_model", f"rl.reward_model_checkpoint={rm_dir}", "eval.batch_size=4")
  seen = []
  scorer = reward_model_scorer(cfg, None, TOK)

  def spy(completions, examples):
    seen.extend(zip(completions, examples))
    return scorer(completions, examples)
  examples = [{"prompt": f"rev {w}", "answer": w[::-1], "domain": d}
              for w, d in [("abc", "a"), ("xyz", "a"), ("pq", "b"), ("mno", "b"), ("kl", "b")]]
  evaluator = Evaluator(cfg, None, TOK, examples, rm_scorer=spy)
  model = build_model(ModelConfig.from_config(cfg), None, seed=5)
  _, params, extra = nnx.split(model, nnx.Param, ...)
  metrics = evaluator(params, extra)
  assert [e for _, e in seen] == examples  # every held-out example once, the padding row not scored
  rm, _ = load_reward_model(rm_dir, cfg, None)
  graphdef, rm_params, rm_extra = nnx.split(rm, nnx.Param, ...)
  row_len = cfg.rl.max_prompt_len + cfg.rl.max_new_tokens + 2
  rows = [encode_side(TOK, e["prompt"], t)[-row_len:] for t, e in seen]
  tokens = np.zeros((len(rows), row_len), np.int32)
  for i, ids in enumerate(rows):
    tokens[i, :len(ids)] = ids
  alone = np.asarray(make_scorer(graphdef)(rm_params, rm_extra, tokens, np.asarray([len(r) for r in rows], np.int32)))
  assert metrics["eval/rm_score"] == pytest.approx(float(alone.mean()), abs=1e-5)
  assert metrics["eval/rm_score/b"] == pytest.approx(float(alone[2:].mean()), abs=1e-5)
  assert "eval/accuracy" in metrics and "eval/accuracy/b" in metrics
  evaluator.close()


# --- several host processes -----------------------------------------------------------------------

_HOST_WORKER = r"""
import json, sys
from meshrl.sharding import hosts
coordinator, processes, process, payload = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
if processes > 1:
  hosts.initialize(coordinator, processes, process)
from meshrl import configs
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl.rewards.sources import reward_pool
from meshrl.sharding.mesh import make_mesh
cfg = configs.load("configs/tiny.py", payload["overrides"])
pool = reward_pool(cfg, make_mesh(cfg.mesh), ByteTokenizer())
judge, verdicts = pool.scorers["judge"], []
finish = judge.finish
judge.finish = lambda d: (lambda out: (verdicts.extend(out[1]["verdicts"]), out)[1])(finish(d))
samples = payload["samples"][process]  # this host's own (completion, example) pairs
rewards, info = pool.score([c for c, _ in samples], [e for _, e in samples])
pool.close()
print("RESULT " + json.dumps({"rewards": rewards.tolist(), "verdicts": verdicts,
                              "per_fn": {k: v.tolist() for k, v in info["per_fn"].items()},
                              "rows": [pool.scorers["reward_model"].rows, judge.rows]}), flush=True)
if processes > 1:
  import jax
  jax.distributed.shutdown()
"""


@pytest.mark.slow  # 30 s (two processes); by default tests/sharding/test_hosts.py runs two hosts' scoring
def test_model_sources_on_two_host_processes_score_as_on_one(tmp_path, rm_dir, judge_dir, rubric):
  """Two host processes (2 devices each, one 4-device mesh) each score their own samples, unevenly
  many and with their own mix of domains (host 0 has four reward-model samples and one for the
  judge, host 1 three judge samples and none for the reward model: two calls of each, a host with no
  sample of its own taking its part): every host's rewards, per-source scores and verdicts, in
  process order, equal one process scoring all the samples on 4 devices. Catches a host that skips a
  call the other makes (the job hangs), rows read from another host's part of a call, and padding
  rows kept."""
  import socket  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  words = ["abc", "dog", "sun", "map", "kiwi", "ox", "pear", "yak", "emu"]
  domains = [["r", "v", "m", "r", "r"], ["j", "v", "j", "j"]]  # per host: host 1 has no RM sample
  samples, at = [], 0
  for host_domains in domains:
    samples.append([[w[::-1] if i % 2 else w, {"prompt": f"rev {w}", "answer": w[::-1], "domain": d}]
                    for i, (w, d) in enumerate(zip(words[at:], host_domains))])
    at += len(host_domains)
  overrides = SMALL + ["mesh.fsdp=4", "rl.prompts_per_step=1", "rl.group_size=4",
                       "rl.reward_sources=r=reward_model;j=judge;m=reward_model:0.5,judge:0.5;*=verifier",
                       f"rl.reward_model_checkpoint={rm_dir}", f"rl.judge_checkpoint={judge_dir}",
                       f"rl.judge_rubrics=*={rubric}", "rl.judge_prompt_len=24", "rl.judge_max_tokens=5"]
  script = tmp_path / "worker.py"
  script.write_text(_HOST_WORKER)
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

  def start(processes, process, payload):
    devices = 4 // processes
    return subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(processes), str(process),
                             json.dumps(payload)], env={**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  procs = [start(2, i, {"overrides": overrides, "samples": samples}) for i in range(2)]
  procs.append(start(1, 0, {"overrides": overrides, "samples": [samples[0] + samples[1]]}))
  outs = [p.communicate(timeout=300)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
  host0, host1, one = (json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:]) for o in outs)
  assert host0["rows"] == host1["rows"] == one["rows"] == [4, 4]  # 2 rows of each call per host
  assert len(host0["verdicts"]) == 1 and len(host1["verdicts"]) == 3
  assert host0["verdicts"] + host1["verdicts"] == one["verdicts"]
  np.testing.assert_allclose(host0["rewards"] + host1["rewards"], one["rewards"], rtol=1e-5, atol=1e-5)
  assert "reward_model" not in host1["per_fn"]  # host 1 scored no sample with it (its part of the calls aside)
  rm_scores = np.asarray(host0["per_fn"]["reward_model"] + [0.0] * len(domains[1]))
  np.testing.assert_allclose(rm_scores, one["per_fn"]["reward_model"], rtol=1e-5, atol=1e-5)
  scored = [d in ("r", "m") for host_domains in domains for d in host_domains]
  assert np.ptp(rm_scores[scored]) > 1e-3 and len(set(one["verdicts"])) > 1  # a row mix-up would show
