"""Several host processes (sharding/hosts.py), with real jax processes on this machine talking over
gloo: data gathered in process order, each host scoring only its own block of groups (or, for partial
rollouts, its uneven share) and getting the one-process scores, each host running only its own
multi-turn environments and sharing their observations, and scripts/rl.py on two processes giving the
one-process metrics: synchronous, asynchronous, partial rollouts and multi-turn (slow)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from meshrl.sharding import hosts

_WORKER = r"""
import json, sys
import numpy as np
from meshrl.sharding import hosts
hosts.initialize(sys.argv[1], 2, int(sys.argv[2]))
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl.rewards import compose
from meshrl.rl.rewards.pool import RewardPool
from meshrl.rl.step.program import score_own_block
me = jax.process_index()
out = {"rows": hosts.gather_rows(np.full((2, 3), me, np.int32)).tolist(),
       "flags": hosts.gather_rows(np.array([me == 0, True])).tolist(),
       "objects": hosts.gather_objects([f"host{me}", {"n": np.int64(me)}])}
block = hosts.own_block(8)
mesh = Mesh(np.array(jax.devices()), ("x",))
spread = jax.device_put(np.arange(8.0), NamedSharding(mesh, PartitionSpec("x")))  # over both hosts
out["to_host"] = hosts.to_host(spread).tolist()
own = np.full((2, 3), me, np.int32) + 10 * np.arange(2, dtype=np.int32)[:, None]  # this host's 2 rows
split_rows = hosts.global_rows(own, NamedSharding(mesh, PartitionSpec("x")))  # each host's rows on its devices
replicated = hosts.global_rows(own, NamedSharding(mesh, PartitionSpec()))  # rows on every device: gathered
out["global_rows"] = {"array": isinstance(split_rows, jax.Array), "whole": hosts.to_host(split_rows).tolist(),
                      "replicated": [isinstance(replicated, np.ndarray), np.asarray(replicated).tolist()]}
table = np.arange(16).reshape(8, 2)
reverse = Mesh(np.array(jax.devices()[::-1]), ("x",))  # host 0's devices hold rows 4..7: not its share
gathers, to_host = [], hosts.to_host
hosts.to_host = lambda x: (gathers.append(x.shape), to_host(x))[1]  # counts the fallback's gathers
out["share_to_host"] = [hosts.share_to_host(jax.device_put(table, NamedSharding(m, spec))).tolist()
                        for m, spec in ((mesh, PartitionSpec("x")), (mesh, PartitionSpec()),
                                        (reverse, PartitionSpec("x")))]  # per host (popped below)
hosts.to_host = to_host
out["share_gathers"] = len(gathers)
out["held_rows"] = np.concatenate([np.asarray(s.data) for s in sorted(
    split_rows.addressable_shards, key=lambda s: s.index[0].start)]).tolist()  # per host (popped below)
batch = json.loads(sys.argv[3])
arrays = {k: np.asarray(v) for k, v in batch["arrays"].items()}
examples = batch["examples"][hosts.own_block(len(batch["examples"]))]  # this host's own 2 prompts
tokenizer = ByteTokenizer()
pool = RewardPool(compose("answer:1.0"), num_workers=1, timeout_s=10)
scored = score_own_block(arrays, examples, tokenizer, pool, group_size=2, max_new_tokens=4,
                         overlong_buffer=0, overlong_penalty_value=0.0)
out["scored"] = {"rewards": scored.rewards.tolist(), "texts": scored.texts, "domains": scored.domains,
                 "valid": scored.sample_valid.tolist(), "errors": scored.info["reward_errors"]}

# Partial rollouts: every host holds every group's example and scores its share of the groups that
# ended, 3 groups (1 and 2) and 1 group (none and 1); the pool records what this host scored.
scored_here, submit = [], pool.submit
pool.submit = lambda texts, exs: (scored_here.append(texts), submit(texts, exs))[1]
out["shares"] = {}
for groups in (3, 1):
  part = {k: v[:2 * groups] for k, v in arrays.items()}
  shared = score_own_block(part, batch["examples"][:groups], tokenizer, pool, examples_everywhere=True,
                           group_size=2, max_new_tokens=4, overlong_buffer=0, overlong_penalty_value=0.0)
  out["shares"][groups] = {"rewards": shared.rewards.tolist(), "texts": shared.texts,
                           "domains": shared.domains, "valid": shared.sample_valid.tolist()}
pool.close()
out["scored_here"] = scored_here

# Asynchronous RL's rollouts in flight: each host holds its own block of their examples; the
# checkpoint's state has all of them, and restoring gives each host its own block back.
import collections, types
from meshrl.rl.step.program import InFlight, in_flight_state, restore_in_flight
run = types.SimpleNamespace(in_flight=collections.deque(
    [InFlight(examples, {"tokens": arrays["tokens"]}, 3)]),
    cfg=types.SimpleNamespace(rl=types.SimpleNamespace(rollout_token_budget=0, prompts_per_step=4)))
saved = json.loads(json.dumps(in_flight_state(run)))  # as the checkpoint's JSON holds it
restore_in_flight(run, saved)
out["in_flight"] = {"saved": [item["examples"] for item in saved], "version": run.in_flight[0].version,
                    "tokens": run.in_flight[0].arrays()["tokens"].tolist()}
out["restored_own"] = run.in_flight[0].examples  # per host (popped below)

# Multi-turn episodes (rl/step/episodes.py): 4 examples x 2 rows; each host resets and steps only the
# environments of its own 4 rows, which answer with the host's index; everything else is shared.
from flax import nnx
from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig
from meshrl.rl.envs.base import StepResult
from meshrl.rl.step.spec import episode_runner
resets = []

class HostEnv:
  def reset(self, task):
    resets.append(task["prompt"])
    return task["prompt"]

  def step(self, action):
    if "<done>" in action:
      return StepResult("", 1.0, True, {})
    return StepResult(f"p{me}", 0.0, False, {})

cfg = configs.load("configs/tiny.py", json.loads(sys.argv[4]))
_, params, extra = nnx.split(build_model(ModelConfig.from_config(cfg, None), None), nnx.Param, ...)
programs = episode_runner(cfg, None, tokenizer, make_env=lambda example: HostEnv())
encoded, encode = [], programs._encode_prompts  # pylint: disable=protected-access
programs._encode_prompts = lambda texts: (encoded.append(list(texts)), encode(texts))[1]
episodes = programs.rollout(params, extra, batch["examples"], jax.random.key(0))
programs.close()
out["multi_turn"] = {"texts": episodes.texts, "tokens": episodes.arrays["tokens"].to_host().tolist(),
                     "rewards": [e.reward for e in episodes.episodes], "resets": resets,
                     "encoded": encoded, "prefilled": episodes.counts["prefill_tokens"]}
print("BLOCK " + json.dumps([block.start, block.stop]), flush=True)
print("RESULT " + json.dumps(out), flush=True)
jax.distributed.shutdown()
"""
# A tiny dense model for the workers' multi-turn episodes (tests/rl/test_multiturn.py's sizes).
MULTI_TURN = ["model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
              "model.head_dim=16", "model.mlp_dim=64", "moe.num_experts=0", "rl.max_prompt_len=24",
              "rl.max_new_tokens=40", "model.max_seq_len=80", "rl.max_obs_tokens=16", "model.init_std=0.3",
              "rl.multi_turn=true", "rl.max_turn_tokens=8", "rl.max_turns=3", "rl.group_size=2",
              "rl.env_workers=2"]


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _batch():
  """4 prompts x 2 samples of reversing words, responses some right and some wrong."""
  from meshrl.model.tokenizer import ByteTokenizer  # pylint: disable=import-outside-toplevel
  tok = ByteTokenizer()
  words = ["abc", "dog", "sun", "map"]
  examples = [{"prompt": f"rev {w}=", "answer": w[::-1], "domain": f"d{i % 2}"} for i, w in enumerate(words)]
  answers = [w[::-1] if j == 0 else w for w in words for j in range(2)]  # first sample of each right
  prompt = np.zeros((8, 4), np.int32)
  response = np.stack([np.asarray(list(a.encode()) + [tok.eos_id], np.int32) for a in answers])  # bytes
  tokens = np.concatenate([prompt, response], axis=1)
  mask = np.concatenate([np.zeros((8, 4), bool), np.ones((8, 4), bool)], axis=1)
  arrays = {"tokens": tokens, "response_mask": mask, "lengths": np.full(8, 4, np.int32)}
  return examples, arrays


def test_bad_job_descriptions_are_refused_by_name():
  with pytest.raises(ValueError, match=r"needs the number of processes \(>= 1, got 0\)"):
    hosts.initialize("127.0.0.1:1234", 0, 0)
  with pytest.raises(ValueError, match=r"this process's id in 0..1 \(got 5\)"):
    hosts.initialize("127.0.0.1:1234", 2, 5)
  assert not hosts.initialize("", 0, -1)  # no job described: one process, nothing joined


def test_prompts_that_do_not_split_over_the_hosts_are_shared():
  """Every host draws the same prompts and scores its share when they do not split into equal
  blocks (paper_3t: 8 prompts on the 1,024 hosts of a v5p 16x16x16) or with partial rollouts."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.groups import shared_prompts  # pylint: disable=import-outside-toplevel
  load = lambda *o: configs.load("configs/tiny.py", ["rl.prompts_per_step=4", *o])  # noqa: E731
  assert not shared_prompts(load(), 1) and not shared_prompts(load(), 2) and not shared_prompts(load(), 4)
  assert shared_prompts(load(), 3) and shared_prompts(load(), 8)
  assert shared_prompts(configs.load("configs/paper_3t.py"), 1024)
  assert shared_prompts(load("rl.engine=continuous", "rl.rollout_token_budget=64"), 2)


def test_two_processes_gather_in_order_and_score_their_own_groups(tmp_path):
  examples, arrays = _batch()
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  payload = json.dumps({"examples": examples, "arrays": {k: v.tolist() for k, v in arrays.items()}})
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(i), payload,
                            json.dumps(MULTI_TURN)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=240)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
  results = [json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:]) for o in outs]
  resets = [r["multi_turn"].pop("resets") for r in results]  # the only per-host values
  encoded = [r["multi_turn"].pop("encoded") for r in results]
  restored = [r.pop("restored_own") for r in results]
  scored_here = [r.pop("scored_here") for r in results]
  held_rows = [r.pop("held_rows") for r in results]
  shares = [r.pop("share_to_host") for r in results]
  assert results[0] == results[1]  # every host ends with the same global values
  got = results[0]
  assert got["rows"] == [[0, 0, 0]] * 2 + [[1, 1, 1]] * 2  # process order
  assert got["flags"] == [True, True, False, True]
  assert got["objects"] == ["host0", {"n": 0}, "host1", {"n": 1}]
  assert got["to_host"] == list(range(8))
  # Each host's own rows as one global array (the rollout's prompts): each holds only its own.
  rows_of = lambda host: [[host] * 3, [host + 10] * 3]  # noqa: E731
  assert got["global_rows"] == {"array": True, "whole": rows_of(0) + rows_of(1),
                                "replicated": [True, rows_of(0) + rows_of(1)]}
  assert held_rows == [rows_of(0), rows_of(1)]
  # Each host's share of a row-split, a replicated and a reverse-ordered array (the last gathered).
  table = np.arange(16).reshape(8, 2)
  assert shares == [[table[:4].tolist()] * 3, [table[4:].tolist()] * 3]
  assert got["share_gathers"] == 1  # only the reverse-ordered array was gathered
  blocks = [json.loads(next(l for l in o.splitlines() if l.startswith("BLOCK "))[6:]) for o in outs]
  assert blocks == [[0, 4], [4, 8]]

  # The one-process reference: the whole batch scored at once.
  from meshrl.model.tokenizer import ByteTokenizer  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.groups import score_rollout  # pylint: disable=import-outside-toplevel
  from meshrl.rl.rewards import compose  # pylint: disable=import-outside-toplevel
  from meshrl.rl.rewards.pool import RewardPool  # pylint: disable=import-outside-toplevel
  pool = RewardPool(compose("answer:1.0"), num_workers=1, timeout_s=10)
  want = score_rollout(arrays, examples, ByteTokenizer(), pool, group_size=2, max_new_tokens=4,
                       overlong_buffer=0, overlong_penalty_value=0.0)
  pool.close()
  assert got["scored"]["rewards"] == want.rewards.tolist() == [1.0, 0.0] * 4
  assert got["scored"]["texts"] == want.texts
  assert got["scored"]["domains"] == want.domains == ["d0", "d0", "d1", "d1"] * 2
  assert got["scored"]["valid"] == [True] * 8 and got["scored"]["errors"] == 0

  # Partial rollouts: shares of 3 groups (1 and 2) and of 1 group (none and 1), gathered in order
  # into the one-process scores.
  for groups in (3, 1):
    assert got["shares"][str(groups)] == {"rewards": want.rewards[:2 * groups].tolist(),
                                          "texts": want.texts[:2 * groups],
                                          "domains": want.domains[:2 * groups], "valid": [True] * 2 * groups}
  # 3 groups: host 0 scored group 0; 1 group: an empty batch (a reward model's calls span every host)
  assert scored_here[0] == [want.texts[0:2], []]
  assert scored_here[1] == [want.texts[2:6], want.texts[0:2]]  # groups 1, 2; then group 0

  # Rollouts in flight: the saved state has both hosts' examples in order; each gets its own back.
  assert got["in_flight"] == {"saved": [examples], "version": 3, "tokens": arrays["tokens"].tolist()}
  assert restored == [examples[:2], examples[2:]]

  # Multi-turn: each host reset only its own rows' environments (examples 0, 1 / 2, 3, two rows
  # each), and every host holds every row's episode, observations from the host that owns the row.
  assert sorted(resets[0]) == [examples[i]["prompt"] for i in (0, 0, 1, 1)]
  assert sorted(resets[1]) == sorted(examples[i]["prompt"] for i in (2, 2, 3, 3))
  # ... and encoded only its own examples' prompts (their first observations); the prefill counts
  # every host's prompt tokens.
  assert encoded == [[[examples[0]["prompt"], examples[1]["prompt"]]],
                     [[examples[2]["prompt"], examples[3]["prompt"]]]]
  assert got["multi_turn"]["prefilled"] == sum(len(ByteTokenizer().encode(ByteTokenizer().render_prompt(
      e["prompt"]))) for e in examples)
  texts = got["multi_turn"]["texts"]
  assert all("<out>p1" not in t for t in texts[:4]) and all("<out>p0" not in t for t in texts[4:])
  assert any("<out>p0" in t for t in texts[:4]) and any("<out>p1" in t for t in texts[4:])


def _one_and_two_processes(tmp_path, config: str, overrides: list[str], devices: int):
  """Runs scripts/rl.py once as one process with `devices` CPU devices (workdir tmp_path/one) and
  once as two processes with half as many each, the same mesh (tmp_path/two); returns the two
  metrics.jsonl record lists, and a reader of JSONL files."""
  base = [sys.executable, "scripts/rl.py", f"--config={config}"] + [f"--config.{o}" for o in overrides]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  port = _free_port()
  runs = [subprocess.Popen(base + [f"--cpu_devices={devices}", f"--workdir={tmp_path / 'one'}"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
  runs += [subprocess.Popen(base + [f"--cpu_devices={devices // 2}", f"--coordinator=127.0.0.1:{port}",
                                    "--num_processes=2", f"--process_id={i}", f"--workdir={tmp_path / 'two'}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in runs]
  assert all(p.returncode == 0 for p in runs), [o[-3000:] for o in outs]
  read = lambda path: [json.loads(line) for line in path.read_text().splitlines()]  # noqa: E731
  return read(tmp_path / "one" / "metrics.jsonl"), read(tmp_path / "two" / "metrics.jsonl"), read


def _timing(key: str) -> bool:
  return key.endswith("_s") or "mfu" in key or key == "compiles"


def _assert_same_metrics(one: list[dict], two: list[dict]) -> None:
  """The same records and keys; floats to reduction-order noise, timings left out."""
  for a, b in zip(one, two, strict=True):
    assert set(a) == set(b)
    for key in (k for k in a if not _timing(k)):
      if isinstance(a[key], float):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
      else:
        assert b[key] == a[key], key


# Partial rollouts: 4 groups of 4 samples of up to 4 tokens through 4 slots, 13 tokens per slot per
# step: 3 groups end in a step (one host scores 1, the other 2), the 4th is carried to the next.
PARTIAL = ["rl.engine=continuous", "rl.group_size=4", "rl.decode_slots=4", "rl.rollout_token_budget=52",
           "rl.max_resample_rounds=0"]


# One prompt of 4 samples per step on two hosts: the prompts do not split, so both draw it (shared).
ONE_PROMPT = ["rl.prompts_per_step=1", "rl.group_size=4"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["rl.max_staleness=1", "rl.tis_level=token"], PARTIAL, ONE_PROMPT,
                                   ONE_PROMPT + ["rl.max_staleness=1", "rl.tis_level=token"]],
                         ids=["sync", "async", "partial", "one_prompt", "one_prompt_async"])
def test_rl_on_two_processes_matches_one_process(tmp_path, extra):
  """scripts/rl.py: 3 RL steps with evaluations and checkpoints, once as one process with 4 CPU
  devices and once as two processes with 2 each (the same 4-device mesh): the same metrics (floats to
  reduction-order noise), files written once, checkpoints from both processes together; also
  asynchronous RL (rollouts in flight, saved with every host's examples), partial rollouts (groups
  carried over steps, ending unevenly over the hosts) and fewer prompts than hosts (every host draws
  the one prompt and scores its share of the samples), synchronous and asynchronous. ~2 min each."""
  small = ["model.num_layers=2", "model.embed_dim=32", "model.head_dim=8", "model.mlp_dim=32",
           "moe.expert_mlp_dim=16", "rl.max_prompt_len=8", "rl.max_new_tokens=4", "model.max_seq_len=16",
           "rl.prompts_per_step=4", "rl.group_size=2", "rl.sft_steps=0", "log.progress_bar=false",
           "log.tensorboard=false", "log.plot=false", "eval.every=2", "eval.num_prompts=8",
           "eval.batch_size=4", "rl.num_steps=3", "checkpoint.every=2", "mesh.fsdp=4"] + extra
  one, two, read = _one_and_two_processes(tmp_path, "configs/tiny.py", small, devices=4)
  assert [r["step"] for r in two] == [1, 2, 3]  # written once, by process 0
  _assert_same_metrics(one, two)
  assert read(tmp_path / "two" / "eval.jsonl") == read(tmp_path / "one" / "eval.jsonl")
  assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2", "3"]
  if extra == PARTIAL:  # groups carried over, and steps that end an odd number of them
    assert all(r["groups_carried"] for r in two) and any(r["groups_ended"] % 2 for r in two)


@pytest.mark.slow
def test_multi_turn_rl_on_two_processes_matches_one_process(tmp_path):
  """scripts/rl.py on configs/tiny_agent.py (multi-turn file-task episodes, warm start on
  demonstrations, multi-turn evaluation): each of two processes runs the environments of its own
  block of episodes and shares their observations, and the metrics and evaluations equal those of
  one process running every environment, synchronously (the preset's asynchronous multi-turn RL is
  refused on several hosts, program.py says why). ~3 min."""
  small = ["rl.max_staleness=0", "rl.sft_steps=2", "rl.sft_batch_size=4", "rl.num_steps=2", "rl.prompts_per_step=2",
           "rl.group_size=2", "rl.num_minibatches=1", "eval.every=2", "eval.num_prompts=3",
           "eval.batch_size=3", "log.progress_bar=false", "log.tensorboard=false", "log.plot=false",
           "checkpoint.enabled=false", "mesh.fsdp=2"]
  one, two, read = _one_and_two_processes(tmp_path, "configs/tiny_agent.py", small, devices=2)
  assert [r["step"] for r in two] == [1, 2]  # written once, by process 0
  assert all(r["turns_mean"] >= 1 and r["extend_tokens"] > 0 for r in two)  # real multi-turn episodes
  _assert_same_metrics(one, two)
  evals_one, evals_two = read(tmp_path / "one" / "eval.jsonl"), read(tmp_path / "two" / "eval.jsonl")
  assert evals_two and [{k: v for k, v in r.items() if not _timing(k)} for r in evals_two] == [
      {k: v for k, v in r.items() if not _timing(k)} for r in evals_one]


@pytest.mark.slow
def test_rl_with_a_reward_model_on_two_processes_matches_one_process(tmp_path):
  """scripts/rl.py with two domains, one scored by a reward model on the mesh and one by its verifier
  (rl/rewards/sources.py), synchronous and then asynchronous with the rewards whitened per domain
  (over the whole batch, not each host's block): on two processes (each filling its own rows of the
  reward model's calls with its own samples) the metrics, the reward model's per-domain scores and
  eval/rm_score included, equal one process's. ~3 min."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  from meshrl.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  from meshrl.train.state import TrainState  # pylint: disable=import-outside-toplevel
  small = ["model.num_layers=2", "model.embed_dim=32", "model.head_dim=8", "model.mlp_dim=32",
           "moe.expert_mlp_dim=16", "rl.max_prompt_len=8", "rl.max_new_tokens=4", "model.max_seq_len=16",
           "rl.prompts_per_step=4", "rl.group_size=2", "rl.sft_steps=0", "log.progress_bar=false",
           "log.tensorboard=false", "log.plot=false", "eval.every=2", "eval.num_prompts=8",
           "eval.batch_size=4", "rl.num_steps=3", "checkpoint.enabled=false", "mesh.fsdp=4",
           "data.tasks=reverse:1.0,arithmetic:1.0"]
  rm_cfg = configs.load("configs/tiny.py", small + ["model.value_head=true", "model.init_std=0.5"])
  _, params, extra = nnx.split(build_model(ModelConfig.from_config(rm_cfg), None, seed=1), nnx.Param, ...)
  with Checkpointer(str(tmp_path / "rm" / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(1, TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state={}, extra=extra),
              config=rm_cfg, force=True)
  sources = ["rl.reward_sources=reverse=reward_model", f"rl.reward_model_checkpoint={tmp_path / 'rm'}"]
  for name, extra_options in (("sync", []), ("async", ["rl.max_staleness=1", "rl.tis_level=token",
                                                     "rl.reward_norm=domain"])):
    one, two, read = _one_and_two_processes(tmp_path / name, "configs/tiny.py", small + sources + extra_options,
                                            devices=4)
    assert all("score/reward_model/reverse" in r for r in two), two[0].keys()
    _assert_same_metrics(one, two)
    evals_one, evals_two = read(tmp_path / name / "one" / "eval.jsonl"), read(tmp_path / name / "two" / "eval.jsonl")
    assert "eval/rm_score" in evals_two[0]
    assert [{k: v for k, v in r.items() if not _timing(k)} for r in evals_two] == [
        {k: v for k, v in r.items() if not _timing(k)} for r in evals_one]
