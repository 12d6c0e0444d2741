"""Every bad config value a run would hit is refused by rl/step/run_spec.check_config (plus configs/checks.py's
serve section for the server) in one line naming the field, before anything runs: a table of the
values users typed (issue 31), and a sweep that gives every numeric field of configs/base.py a
nonsense value."""

import ml_collections
import pytest

from meshrl import configs
from meshrl.configs import checks
from meshrl.rl.step import driver as loop

# (override, fragment the one-line error must contain). Each was accepted, or failed with another
# exception after the run had written its config, before issue 31.
BAD = [
    ("optim.learning_rate=-0.1", "optim.learning_rate=-0.1 must be positive"),
    ("optim.learning_rate=0.0", "optim.learning_rate=0.0 must be positive"),
    ("rl.sft_learning_rate=-1e-3", "rl.sft_learning_rate=-0.001 must be positive"),
    ("rl.sft_steps=-1", "rl.sft_steps=-1 must be at least 0"),
    ("rl.num_steps=-1", "rl.num_steps=-1 must be at least 0"),
    ("checkpoint.every=0", "checkpoint.every=0 must be at least 1"),
    ("checkpoint.max_to_keep=0", "checkpoint.max_to_keep=0 must be at least 1"),
    ("rl.num_minibatches=0", "rl.num_minibatches=0 must be at least 1"),
    ("log.every=0", "log.every=0 must be at least 1"),
    ("model.embed_dim=-128", "model.embed_dim=-128 must be at least 1"),
    ("model.num_layers=0", "model.num_layers=0 must be at least 1"),
    ("model.head_dim=7", "model.head_dim=7 must be even"),
    ("model.num_kv_heads=3", "model.num_heads=4 is not divisible by model.num_kv_heads=3"),
    ("model.dtype=int8", "model.dtype='int8' is not one of"),
    ("model.param_dtype=float64x", "model.param_dtype='float64x' is not one of"),
    ("model.attention_type=mha", "model.attention_type='mha'"),
    ("model.rope_scaling=ntk", "model.rope_scaling='ntk' is not one of"),
    ("model.init_std=0.0", "model.init_std=0.0 must be positive"),
    ("attention.impl=flash", "attention.impl='flash' is not one of"),
    ("attention.block_q=0", "attention.block_q=0 must be at least 1"),
    ("moe.num_experts_per_tok=0", "moe.num_experts_per_tok=0 must be at least 1"),
    ("moe.expert_mlp_dim=-1", "moe.expert_mlp_dim=-1 must be at least 1"),
    ("moe.score_func=relu", "moe.score_func='relu' is not one of"),
    ("moe.n_group=3", "moe.n_group=3 must divide moe.num_experts=4"),
    ("moe.aux_loss_coef=-0.01", "moe.aux_loss_coef=-0.01 must be at least 0.0"),
    ("optim.name=lion", "optim.name='lion' is unknown"),
    ("optim.schedule=step", "optim.schedule='step' is unknown"),
    ("optim.b2=1.5", "optim.b2=1.5 must lie in [0, 1)"),
    ("optim.eps=0.0", "optim.eps=0.0 must be positive"),
    ("optim.end_lr_ratio=2.0", "optim.end_lr_ratio=2.0 must lie in [0, 1]"),
    ("mesh.train_rules=embed=fsdp;bogus", "mesh.train_rules='embed=fsdp;bogus': bad rule 'bogus'"),
    ("mesh.rollout_rules=vocab=nowhere", "mesh.rollout_rules='vocab=nowhere'"),
    ("rl.gamma=1.5", "rl.gamma=1.5 must lie in [0.0, 1.0]"),
    ("rl.adv_eps=0.0", "rl.adv_eps=0.0 must be positive"),
    ("rl.entropy_coef=-0.1", "rl.entropy_coef=-0.1 must be at least 0"),
    ("rl.max_nonfinite_steps=-1", "rl.max_nonfinite_steps=-1 must be at least 0"),
    ("rl.speculative_k=0", "rl.speculative_k=0 must be at least 1"),
    ("rl.stop_tokens=13,x", "rl.stop_tokens='13,x' must be comma-separated token ids"),
    ("rl.overlong_buffer=-2", "rl.overlong_buffer=-2 must be at least 0"),
    ("rl.overlong_buffer=99", "rl.overlong_buffer=99 must lie in [0, rl.max_new_tokens=8]"),
    ("rl.sft_batch_size=0", "rl.sft_batch_size=0 must be at least 1"),
    ("data.seq_len=0", "data.seq_len=0 must be at least 1"),
    ("data.num_workers=-1", "data.num_workers=-1 must be at least 0"),
    ("data.eval_fraction=1.0", "data.eval_fraction=1.0 must lie in [0.0, 1.0)"),
    ("data.jsonl=/no/such.jsonl", "data.jsonl='/no/such.jsonl': no such file"),
    ("eval.jsonl=/no/such.jsonl", "eval.jsonl='/no/such.jsonl': no such file"),
    ("data.quarantine=/no/such/dir/q.jsonl", "data.quarantine='/no/such/dir/q.jsonl': its folder"),
    ("eval.num_prompts=0", "eval.num_prompts=0 must be at least 1"),
    ("seed=-1", "seed=-1 must lie in [0, 2147483647]"),
    ("name=", "name='' is empty"),
    ("workdir=", "workdir='' is empty"),
    ("rl.env_backend=docker", "rl.env_backend='docker' is not one of"),
]


@pytest.mark.parametrize("override, fragment", BAD, ids=[o for o, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_field(override, fragment):
  cfg = configs.load("configs/tiny.py", [override])
  with pytest.raises(ValueError) as raised:
    loop.check_config(cfg, 8)
  message = str(raised.value)
  assert fragment in message, message
  assert "\n" not in message, message


# (overrides, fragment): the hard-task options of issue 33 (warm-start level, RFT, curriculum, retries,
# replay), some bad only beside another setting they need.
BAD_HARD_TASKS = [
    (["rl.sft_difficulty=5"], "rl.sft_difficulty='5': domain 'reverse' (reverse) has levels 1..4"),
    (["rl.sft_difficulty=-1"], "rl.sft_difficulty='-1': '-1' is not a level"),
    (["rl.sft_difficulty=1:0.9,2:0"], "rl.sft_difficulty='1:0.9,2:0': the weight 0.0 of level 2 must be positive"),
    (["rl.sft_difficulty=rev=1:1,2:0.5;*=1"], "rl.sft_difficulty='rev=1:1,2:0.5;*=1': 'rev' is not a generated domain"),
    (["rl.sft_difficulty=reverse=1;reverse=2"], "rl.sft_difficulty='reverse=1;reverse=2': domain 'reverse' has two entries"),
    (["rl.sft_difficulty=reverse=1:1,5:1"], "rl.sft_difficulty='reverse=1:1,5:1': domain 'reverse' (reverse) has levels 1..4"),
    (["rl.sft_difficulty=reverse="], "rl.sft_difficulty='reverse=': 'reverse=' is not 'domain=levels'"),
    (["rl.sft_difficulty=reverse=1:0"], "rl.sft_difficulty='reverse=1:0': the weight 0.0 of level 1 must be positive"),
    (["rl.rft_every=-1"], "rl.rft_every=-1"),
    (["rl.rft_every=1", "rl.rft_steps=0"], "rl.rft_steps=0"),
    (["rl.rft_every=1", "rl.rft_bank=0"], "rl.rft_bank=0"),
    (["rl.rft_every=1", "rl.rft_learning_rate=0.0"], "rl.rft_learning_rate=0.0"),
    (["rl.rft_every=1", "data.seq_len=128"], "data.seq_len=128 (the rows of rl.rft_every's SFT rounds)"),
    (["data.level_curriculum=revers"], "data.level_curriculum='revers': 'revers' is not a generated domain"),
    (["data.level_curriculum=reverse", "data.level_curriculum_floor=9"], "data.level_curriculum_floor=9"),
    (["data.level_curriculum=reverse", "data.level_curriculum_max=7"], "data.level_curriculum_max=7"),
    (["data.level_curriculum=reverse", "data.difficulty=4", "data.level_curriculum_max=3"],
     "data.level_curriculum_max=3"),
    (["data.level_curriculum=reverse", "data.level_curriculum_promote=1.5"], "data.level_curriculum_promote=1.5"),
    (["data.level_curriculum=reverse", "data.level_curriculum_demote=0.8"], "data.level_curriculum_demote=0.8"),
    (["data.level_curriculum=reverse", "data.level_curriculum_window=0"], "data.level_curriculum_window=0"),
    (["rl.retry_share=0.0"], "rl.retry_share=0.0"),
    (["rl.retry_unsolved=-1"], "rl.retry_unsolved=-1"),
    (["rl.replay_groups=-2"], "rl.replay_groups=-2"),
    (["rl.replay_groups=1000000000"], "rl.replay_groups=1000000000 would hold"),  # past half the host's memory
]


@pytest.mark.parametrize("overrides, fragment", BAD_HARD_TASKS, ids=[",".join(o) for o, _ in BAD_HARD_TASKS])
def test_a_bad_hard_task_setting_is_one_line_naming_the_field(overrides, fragment):
  cfg = configs.load("configs/tiny.py", overrides)
  with pytest.raises(ValueError) as raised:
    loop.check_config(cfg, 8)
  assert fragment in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_non_finite_numbers_are_refused_by_the_loader():
  with pytest.raises(configs.ConfigError, match=r"optim.learning_rate expects a finite number, got '1e999'"):
    configs.load("configs/tiny.py", ["optim.learning_rate=1e999"])


@pytest.mark.parametrize("override, fragment", [
    ("serve.slots=0", "serve.slots=0 must be at least 1"),
    ("serve.decode_chunk=-1", "serve.decode_chunk=-1 must be at least 1"),
    ("serve.prefix_block=0", "serve.prefix_block=0 must be at least 1"),
    ("serve.prefix_cache_mb=-1.0", "serve.prefix_cache_mb=-1.0 must be at least 0.0"),
    ("serve.max_len=-5", "serve.max_len=-5 must lie in [0, 64]"),
    ("serve.max_len=65", "serve.max_len=65 must lie in [0, 64]")])
def test_serve_section(override, fragment):
  with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace(".", r"\.")):
    checks.check_sections(configs.load("configs/tiny.py", [override]), "serve")


def _numeric_fields(config, prefix=""):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _numeric_fields(value, prefix + key + ".")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield prefix + key


# Fields where -1 is a meaning, not an error, and where it is only read in another mode (checked in
# that mode by the sweep's variants below).
NEGATIVE_IS_VALID = {"mesh.data", "mesh.fsdp", "mesh.expert", "mesh.sequence", "mesh.tensor",
                     "rm.warmup_steps"}  # -1: optim.warmup_steps (checks.check_rm refuses -2)
VARIANTS = {  # a field read only in some mode is swept in that mode
    "model.q_lora_rank": ["model.attention_type=mla"], "model.kv_lora_rank": ["model.attention_type=mla"],
    "model.qk_nope_head_dim": ["model.attention_type=mla"],
    "model.qk_rope_head_dim": ["model.attention_type=mla"], "model.v_head_dim": ["model.attention_type=mla"],
    "model.rope_factor": ["model.rope_scaling=yarn"], "model.rope_original_max_len": ["model.rope_scaling=yarn"],
    "model.rope_beta_fast": ["model.rope_scaling=yarn"], "model.rope_beta_slow": ["model.rope_scaling=yarn"],
    "model.rope_mscale": ["model.rope_scaling=yarn"], "model.rope_mscale_all_dim": ["model.rope_scaling=yarn"],
    "moe.shared_expert_mlp_dim": ["moe.num_shared_experts=1"],
    **{f"data.level_curriculum_{name}": ["data.level_curriculum=all"]  # issue 33's curriculum, when on
       for name in ("floor", "max", "promote", "demote", "window")},
}


@pytest.mark.parametrize("field", sorted(set(_numeric_fields(configs.load("configs/base.py")))
                                         - NEGATIVE_IS_VALID))
def test_every_numeric_field_refuses_a_negative_value_by_name(field):
  """-1 (or -0.5) in any numeric field of base.py: refused naming that field, by the run's checks
  (RL) or the server's. A field a check forgot fails here."""
  cfg = configs.load("configs/tiny.py")
  value = -0.5 if isinstance(checks.value_of(cfg, field), float) else -1
  cfg = configs.load("configs/tiny.py", VARIANTS.get(field, []) + [f"{field}={value}"])
  with pytest.raises(ValueError) as raised:
    loop.check_config(cfg, 8)
    checks.check_sections(cfg, "serve")
    checks.check_sections(cfg, "rm")  # scripts/train_rm.py's section
  assert field in str(raised.value), str(raised.value)


@pytest.mark.parametrize("preset", ["tiny", "tiny:peer", "tiny:dense", "tiny_agent", "tiny_agent:sandbox", "tiny_hard", "tiny_hard:reverse", "base", "v5e_8",
                                    "paper_3t", "deepseek_v3", "qwen3_moe_30b"])
def test_every_preset_passes_the_checks(preset):
  """The checks refuse nonsense, not the presets' own settings (no device count: pod presets). A
  sandbox preset on a machine without bubblewrap (README: a laptop with only Python) is refused in one
  line naming rl.env_backend, and its other settings pass with the in-memory backend."""
  path = f"configs/{preset.split(':')[0]}.py" + (f":{preset.split(':')[1]}" if ":" in preset else "")
  cfg = configs.load(path)
  if cfg.rl.env_backend == "sandbox" and not _sandbox_runs():
    with pytest.raises(ValueError, match=r"^rl.env_backend='sandbox' cannot run here: [^\n]*$"):
      loop.check_config(cfg)
    cfg = configs.load(path, ["rl.env_backend=memory"])
  loop.check_config(cfg)
  checks.check_sections(cfg, "serve")


def _sandbox_runs() -> bool:
  from meshrl.rl.envs import file_sandbox  # pylint: disable=import-outside-toplevel
  try:
    file_sandbox.check_backend_runs("sandbox")
  except ValueError:
    return False
  return True


def test_the_run_is_built_from_the_checked_spec():
  """check_config returns the run spec and build_run takes its parts rather than reading the config
  again: a spec whose loss, generation and update shape differ from the config's is what the run holds
  (fails if build_run rebuilt any of them from cfg)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.program import build_run  # pylint: disable=import-outside-toplevel
  from meshrl.train.init_from import initial_model  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", ["rl.prompts_per_step=2", "rl.group_size=2", "rl.num_minibatches=1"])
  spec = loop.check_config(cfg)
  assert spec.batch_size == 4 and spec.model == loop.build_spec(cfg).model
  assert spec.generation.group_size == 2 and spec.loss.clip_low == cfg.rl.clip_low
  changed = dataclasses.replace(
      spec, loss=dataclasses.replace(spec.loss, clip_low=0.123),
      generation=dataclasses.replace(spec.generation, step=dataclasses.replace(
          spec.generation.step, sampler=dataclasses.replace(spec.generation.step.sampler, temperature=0.5))))
  run = build_run(cfg, None, initial_model(cfg, None), spec.tokenizer, spec=changed)
  try:
    assert run.run_spec is changed and run.spec.clip_low == 0.123
    assert run.rollout.spec.step.sampler.temperature == 0.5
  finally:
    run.close()


def test_generation_options_of_the_config_reach_the_run_spec():
  """rl.prefill_chunk and rl.kv_host_bytes (issue 34) are read into the run's generation spec, which
  every generator of the run is built from (they were once set only by tests on the spec itself)."""
  cfg = configs.load("configs/tiny.py", ["rl.prefill_chunk=4", "rl.kv_host_bytes=1048576"])
  spec = loop.check_config(cfg)
  assert (spec.generation.prefill_chunk, spec.generation.kv_host_bytes) == (4, 1048576)
  with pytest.raises(ValueError, match="rl.prefill_chunk=-2"):
    loop.check_config(configs.load("configs/tiny.py", ["rl.prefill_chunk=-2"]))


def test_check_config_builds_each_part_once(monkeypatch):
  """check_config is "build the spec": the model numbers once per rule set (training, generation), the
  generation spec, the loss spec and the tokenizer once each, the cross-checks reading the built parts
  (fails if it checks by building a part and then builds it again, as it once did for all four)."""
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  from meshrl.rl.algo import losses  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step import run_spec, spec as spec_lib  # pylint: disable=import-outside-toplevel
  from meshrl.sharding.rules import rules_from_config  # pylint: disable=import-outside-toplevel
  built = []

  def counted(name, fn):
    def wrapper(*args, **kwargs):
      built.append((name, kwargs.get("rules")))
      return fn(*args, **kwargs)
    return wrapper

  monkeypatch.setattr(ModelConfig, "from_config", classmethod(counted("model", ModelConfig.from_config.__func__)))
  monkeypatch.setattr(losses.LossSpec, "from_config", classmethod(counted("loss", losses.LossSpec.from_config.__func__)))
  for module in (run_spec, spec_lib):
    monkeypatch.setattr(module, "generation_spec", counted("generation", spec_lib.generation_spec))
  monkeypatch.setattr(run_spec, "tokenizer_from_config", counted("tokenizer", run_spec.tokenizer_from_config))
  cfg = configs.load("configs/tiny.py", ["rl.multi_turn=false"])
  spec = loop.check_config(cfg, 8)
  names = [name for name, _ in built]
  assert sorted(names) == ["generation", "loss", "model", "model", "tokenizer"], built
  assert [rules for name, rules in built if name == "model"] == [None, rules_from_config(cfg.mesh, "rollout")]
  assert spec.rollout_model.kernel.rules == rules_from_config(cfg.mesh, "rollout")
