"""scripts/aot_compile.py and rl/step/aot.py: the real RL programs compile for TPU topologies through
libtpu (compile only, on this CPU), with per-chip figures read from the compiled program, and bad
input fails with the numbers. Skipped where libtpu (the `tpu` extra) is not installed."""

import json
import os

import pytest

from meshrl import configs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["rl.prompts_per_step=4", "rl.group_size=2", "rl.num_minibatches=1", "rl.max_prompt_len=8",
         "rl.max_new_tokens=8", "rl.sft_batch_size=4", "data.seq_len=16", "model.max_seq_len=16"]


def _small(*overrides):
  return configs.load("configs/tiny.py", SMALL + list(overrides))


@pytest.fixture(scope="module")
def aot():
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
  from meshrl.rl.step import aot as module  # pylint: disable=import-outside-toplevel
  return module


def _shard_bytes(tree):
  """Bytes per chip of a pytree of ShapeDtypeStructs with shardings (the first device's shard)."""
  import jax  # pylint: disable=import-outside-toplevel
  import math  # pylint: disable=import-outside-toplevel
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.slow  # about 35 s on a quiet 2-core machine
def test_update_compiles_for_v5e_2x2_expert_parallel(aot):
  """The RL update on fsdp=2 x expert=2 of a v5e 2x2: the figures come from the compiled program."""
  cfg = _small("mesh.fsdp=2", "mesh.expert=2")
  devices = aot.topology_devices("v5e:2x2")
  assert len(devices) == 4 and devices[0].platform == "tpu"
  mesh = aot.topology_mesh(cfg, devices)
  report = aot.compile_step("update", cfg, mesh, "v5e:2x2")
  assert report.chips == 4 and report.mesh["expert"] == 2
  assert report.hbm_per_chip == int(15.75 * 2 ** 30)  # v5e: 16 GiB chips, 15.75 GiB usable
  assert report.fits is True and not report.diagnosis
  per_chip = report.per_chip
  assert per_chip["total"] == (per_chip["argument"] + per_chip["output"] + per_chip["temp"]
                               + per_chip["code"] - per_chip["alias"])
  # The compiled program's arguments are the state's and batch's shards (plus TPU tile padding, 18%
  # for tiny's narrow arrays on fsdp=4): an input compiled replicated would overshoot.
  program = aot.update_program(cfg, mesh)
  sharded = _shard_bytes(program.args)
  import jax  # pylint: disable=import-outside-toplevel
  whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.args))
  assert sharded <= per_chip["argument"] <= 1.3 * sharded < 0.6 * whole
  assert report.flops > 0 and report.model_flops > 0
  assert report.projected_step_s == pytest.approx(
      report.model_flops / (4 * 197e12 * aot.ASSUMED_MFU))
  assert report.collective_bytes.get("all-to-all", 0) > 0  # tokens travel to their experts
  assert report.collective_bytes.get("all-reduce", 0) + report.collective_bytes.get("reduce-scatter", 0) > 0


def test_decode_compiles_for_v5p_2x2x1_ring_and_experts(aot):
  """One decode step, the KV cache on the `sequence` axis and the experts on `expert` (v5p 2x2x1)."""
  cfg = _small("mesh.expert=2", "mesh.sequence=2", "attention.impl=ring")
  report = aot.compile_steps(cfg, "v5p:2x2x1", ["decode"])[0]
  assert report.step == "decode" and report.chips == 4 and report.mesh["sequence"] == 2
  assert report.hbm_per_chip > 90 * 2 ** 30  # v5p: 95 GiB chips
  assert report.fits is True and report.per_chip["total"] > 0
  assert report.tokens == 4 * 2  # one token per row
  assert report.per_chip["alias"] > 0  # the cache is donated and written in place
  # experts' tokens: moe.ep_exchange=auto gives decode steps all_to_all on TPU (ragged for training and prefill)
  assert report.collective_bytes.get("all-to-all", 0) > 0 and "ragged-all-to-all" not in report.collective_bytes


def test_prefill_compiles_for_v5e_2x2(aot):
  cfg = _small("mesh.fsdp=2", "mesh.expert=2")
  report = aot.compile_steps(cfg, "v5e:2x2", ["prefill"])[0]
  assert report.hbm_per_chip == int(15.75 * 2 ** 30)  # v5e: 16 GiB chips, 15.75 GiB usable
  assert report.fits is True and report.tokens == 4 * 8 and report.flops > 0


def test_measure_names_the_bytes_of_a_program_that_does_not_fit(aot):
  """libtpu's out-of-memory becomes fits=False with the bytes required and available, not a crash."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  mesh = aot.topology_mesh(_small("mesh.fsdp=4"), aot.topology_devices("v5e:2x2"))
  big = jax.ShapeDtypeStruct((2 ** 33 // 4,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  program = aot.Program(jax.jit(lambda x: (jnp.sin(x), jnp.cos(x), jnp.exp(x))), (big,), 1, 1.0)
  report = aot.measure("toy", program, mesh, "v5e:2x2")
  assert report.fits is False and report.per_chip == {}
  assert "step 'toy' does not fit" in report.diagnosis
  assert "exceeds available HBM (15.75G)" in report.diagnosis and "8.00 GiB" in report.diagnosis


@pytest.mark.slow
def test_sft_compiles_for_v5e_2x2(aot):
  report = aot.compile_steps(_small("mesh.fsdp=4"), "v5e:2x2", ["sft"])[0]
  assert report.fits is True and report.flops > 0


def test_bad_topology_and_mesh_name_the_numbers(aot):
  with pytest.raises(ValueError, match=r"'v5x:2x2' is not a TPU topology"):
    aot.topology_devices("v5x:2x2")
  with pytest.raises(ValueError, match=r"v5p:3x3x3"):
    aot.topology_devices("v5p:3x3x3")
  devices = aot.topology_devices("v5e:2x2")
  with pytest.raises(ValueError, match=r"topology's 4 chips.*multiply to 6"):
    aot.topology_mesh(_small("mesh.fsdp=3", "mesh.expert=2"), devices)
  with pytest.raises(ValueError, match=r"unknown step\(s\) \['train'\]"):
    aot.compile_steps(_small(), "v5e:2x2", ["train"])


def test_collective_bytes_and_largest_buffers_read_hlo():
  from meshrl.sharding import traffic  # pylint: disable=import-outside-toplevel
  hlo = "\n".join([
      "  %all-gather.1 = bf16[8,128]{1,0} all-gather(bf16[2,128]{1,0} %p), dimensions={0}",
      "  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %q), dimensions={0}",
      "  %agd = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %ags)",
      "  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %k)",
      "  %cpd = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}, u32[], u32[]) %cps)",
      "  %a2a = (f32[2,3]{1,0}, f32[2,3]{1,0}) all-to-all(f32[2,3]{1,0} %x, f32[2,3]{1,0} %y)",
      "  ROOT %big = f32[1024,1024]{1,0} add(f32[1024,1024]{1,0} %u, f32[1024,1024]{1,0} %v)"])
  assert traffic.collective_bytes(hlo) == {"all-gather": 8 * 128 * 2 + 16 * 4, "all-to-all": 2 * 24,
                                           "collective-permute": 8 * 4}
  assert traffic.largest_buffers(hlo, 1) == ["big f32[1024,1024] 0.00 GiB"]


def _script(*args):
  """Runs scripts/aot_compile.py's main in this process -> its exit status."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("aot_compile_script", os.path.join(REPO, "scripts",
                                                                                   "aot_compile.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.cli.run(module.main, list(args))


@pytest.mark.slow
def test_script_exits_1_naming_a_step_that_does_not_fit(aot, tmp_path, capsys):
  """A decode step whose 1024 x 131072-slot cache (34 GB per chip) cannot fit a 16 GiB chip: exit 1,
  the step and the bytes named, the JSON written."""
  out = tmp_path / "aot.json"
  status = _script("--config=configs/tiny.py", "--config.mesh.fsdp=4", "--config.rl.prompts_per_step=128",
                   "--config.rl.max_prompt_len=131064", "--config.model.max_seq_len=131072",
                   "--topology=v5e:2x2", "--step=decode", f"--json={out}")
  err = capsys.readouterr().err
  assert status == 1, err[-2000:]
  assert "step 'decode'" in err and "does not fit" in err and "15.75" in err
  report = json.loads(out.read_text())[0]
  assert report["step"] == "decode" and report["fits"] is False and report["diagnosis"]


def test_script_rejects_unknown_topology_mismatched_mesh_and_step(aot, capsys):
  """Exit 2 with the numbers, before anything compiles."""
  assert _script("--config=configs/tiny.py", "--topology=v5e:3x3x3x3", "--step=update") == 2
  assert "not a TPU topology" in capsys.readouterr().err
  assert _script("--config=configs/tiny.py", "--config.mesh.fsdp=8", "--topology=v5e:2x2") == 2
  err = capsys.readouterr().err
  assert "4 chips" in err and "fsdp=8" in err
  assert _script("--config=configs/tiny.py", "--topology=v5e:2x2", "--step=update,rollout") == 2
  assert "['rollout']" in capsys.readouterr().err
  assert _script("--config=configs/tiny.py", "--step=update") == 2
  assert capsys.readouterr().err == ("error: --topology is needed to compile (e.g. --topology=v5e:2x2); "
                                     "--count_params alone needs none.\n")


def test_count_params_needs_no_topology(capsys):
  """The README's `aot_compile.py --config=configs/paper_3t.py --count_params` exited 2 (--topology
  was required even to count)."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step import aot  # pylint: disable=import-outside-toplevel
  assert _script("--config=configs/paper_3t.py", "--count_params") == 0
  counts = aot.parameter_counts_of(configs.load("configs/paper_3t.py"))
  assert capsys.readouterr().out == (f"# configs/paper_3t.py: {counts['total']:.4g} parameters, "
                                     f"{counts['active_per_token']:.4g} active per token (from shapes)\n")


def test_generation_layout_trades_a_reshard_for_gather_free_decode_steps(aot):
  """Decode with the weights in the training layout all-gathers them over fsdp at every step; with
  rl.generation_layout=gathered it reads them locally (more argument bytes per chip), and the one-off
  reshard program is where the all-gather went."""
  cfg = _small("mesh.fsdp=4", "model.num_layers=1")
  mesh = aot.topology_mesh(cfg, aot.topology_devices("v5e:2x2"))
  train = aot.compile_step("decode", cfg, mesh, "v5e:2x2")
  gathered_cfg = _small("mesh.fsdp=4", "model.num_layers=1", "rl.generation_layout=gathered")
  gathered = aot.compile_step("decode", gathered_cfg, mesh, "v5e:2x2")
  reshard = aot.compile_step("reshard", gathered_cfg, mesh, "v5e:2x2")
  assert train.collective_bytes.get("all-gather", 0) > 0
  assert gathered.collective_bytes.get("all-gather", 0) < train.collective_bytes["all-gather"] / 4
  assert gathered.per_chip["argument"] > train.per_chip["argument"]  # the less split copy
  assert reshard.collective_bytes.get("all-gather", 0) > 0
  assert "reshard" in aot.default_steps(gathered_cfg) and "reshard" not in aot.default_steps(cfg)


def test_batch_compiles_for_v5p_2x2x1_split_like_the_update_batch(aot):
  """The update batch's per-token fields assembled on the devices (rl/batches/rows.py, batches.align_on_devices,
  zigzag) for a ring update on fsdp=2 x sequence=2: compiled for TPU, every field lands split over the
  batch and `sequence` axes like the update's tokens; part of --step=all."""
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  cfg = _small("mesh.fsdp=2", "mesh.sequence=2", "attention.impl=ring")
  mesh = aot.topology_mesh(cfg, aot.topology_devices("v5p:2x2x1"))
  report = aot.compile_step("batch", cfg, mesh, "v5p:2x2x1")
  assert report.fits is True and report.per_chip["total"] > 0
  plain = aot.compile_step("batch", _small("mesh.fsdp=2", "mesh.sequence=2"), mesh, "v5p:2x2x1")
  swapped = report.collective_bytes.get("collective-permute", 0) - plain.collective_bytes.get("collective-permute", 0)
  assert swapped > 0  # the zigzag's chunk swaps, which a contiguous update (no ring) has not
  program = aot.batch_program(cfg, mesh)
  compiled = program.fn.lower(*program.args).compile()
  assert set(compiled.output_shardings) == {"tokens", "positions", "segment_ids", "targets", "loss_mask",
                                            "old_logprobs"}
  for sharding in compiled.output_shardings.values():
    assert sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("fsdp", "sequence")), 2)
  assert "batch" in aot.default_steps(cfg)


def test_routes_compile_for_v5p_2x2x1_split_like_the_update_batch(aot):
  """Routing replay's routes, assembled on the devices (rl/batches/routes.py) for a ring update on fsdp=2 x
  sequence=2: compiled for TPU, the output lands split over the batch and `sequence` axes like the
  update's tokens. Without routing replay there is nothing to assemble: left out of --step=all and
  refused by name."""
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  cfg = _small("mesh.fsdp=2", "mesh.sequence=2", "attention.impl=ring")
  mesh = aot.topology_mesh(cfg, aot.topology_devices("v5p:2x2x1"))
  report = aot.compile_step("routes", cfg, mesh, "v5p:2x2x1")
  assert report.fits is True and report.per_chip["total"] > 0
  program = aot.routes_program(cfg, mesh)
  compiled = program.fn.lower(*program.args).compile()
  assert compiled.output_shardings.is_equivalent_to(
      NamedSharding(mesh, PartitionSpec("fsdp", None, "sequence", None)), 4)
  assert program.args[1].shape == (1, 8, 16, 2)  # [L, B, S, K] of the rollout (1 MoE layer)
  assert "routes" in aot.default_steps(cfg)
  no_replay = _small("mesh.fsdp=2", "mesh.sequence=2", "attention.impl=ring", "rl.replay_routing=false")
  assert "routes" not in aot.default_steps(no_replay)
  with pytest.raises(ValueError, match="--step=routes needs rl.replay_routing=True"):
    aot.routes_program(no_replay, mesh)


@pytest.mark.slow  # about 2 minutes: the pipelined update compiles through libtpu
def test_two_slice_pipeline_reports_its_bubble_and_generates_stage_free(aot):
  """mesh.stage=2 over two v5e 2x2 slices (4 blocks, 8 rows over fsdp=2 x expert=2, 2 microbatches):
  the update compiles through the pipeline and reports 2 microbatches and a bubble of 1/3, its
  projection divided by 1 - 1/3; generation's parameters are stage-free (no `stage` in any
  prefill/decode argument: every stage group holds every layer), the reshard to them is part of
  --step=all and moves bytes across the slices; the update's weights stay split over the stages."""
  import jax  # pylint: disable=import-outside-toplevel
  cfg = _small("model.num_layers=4", "moe.first_k_dense=2", "mesh.stage=2", "mesh.num_slices=2",
               "mesh.fsdp=2", "mesh.expert=2")
  mesh = aot.topology_mesh(cfg, aot.topology_devices("v5e:2x2", num_slices=2))
  assert dict(mesh.shape)["stage"] == 2 and {d.slice_index for d in mesh.devices[0, 0].flat} == {0}
  assert "reshard" in aot.default_steps(cfg)
  for step in ("prefill", "decode"):
    program = aot.PROGRAMS[step](cfg, mesh)
    specs = [x.sharding.spec for x in jax.tree.leaves(program.args) if hasattr(x, "sharding")]
    assert specs and not any("stage" in str(spec) for spec in specs), step
  update = aot.update_program(cfg, mesh)
  assert any("stage" in str(x.sharding.spec) for x in jax.tree.leaves(update.args[0].params))
  reshard = aot.compile_step("reshard", cfg, mesh, "v5e:2x2")
  assert reshard.dcn_bytes > 0  # each slice receives the other's layers
  report = aot.compile_step("update", cfg, mesh, "v5e:2x2")
  assert report.fits and report.microbatches == 2 and report.bubble_fraction == pytest.approx(1 / 3)
  assert report.projected_step_s == pytest.approx(report.model_flops / (8 * 197e12 * aot.ASSUMED_MFU) * 1.5)
  assert report.dcn_bytes > 0 and report.grad_collective_bytes > 0


@pytest.mark.slow  # about 2 minutes: 128 compile-only chips
def test_decode_step_compiles_with_stages_across_slices_and_a_sequence_split_cache(tmp_path):
  """paper_3t's layout, shrunk: two v5p:4x4x4 slices, one stage each, expert=8 x sequence=8 (the KV
  cache split over `sequence`). The decode step runs whole on every stage group (rl/step/aot.py
  decode_program); left to the partitioner, its pool and slot updates crashed libtpu's all-gather
  simplifier (SIGABRT, hence a subprocess), as paper_3t's two-slice decode did after the generation
  core replaced the rollout."""
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  out = tmp_path / "decode.json"
  small = ["model.num_layers=4", "model.embed_dim=1024", "model.mlp_dim=2048", "moe.num_experts=128",
           "moe.expert_mlp_dim=256", "moe.shared_expert_mlp_dim=256", "model.vocab_size=4096",
           "rl.prompts_per_step=1", "mesh.stage=2", "mesh.expert=8", "mesh.sequence=8"]
  result = subprocess.run([sys.executable, "scripts/aot_compile.py", "--config=configs/paper_3t.py",
                           "--topology=v5p:4x4x4", "--num_slices=2", "--step=decode", f"--json={out}",
                           *[f"--config.{o}" for o in small]], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads(out.read_text())[0]
  assert report["step"] == "decode" and report["fits"] and report["mesh"]["stage"] == 2


def test_prefill_compiles_the_chunked_prefill_and_keeps_its_cache_split(aot):
  """rl.prefill_chunk (issue 34) reaches the AOT prefill: on fsdp=2 x expert=2 of a v5e 2x2, chunks of
  4 over 16-token prompts compile another program (other temp bytes) whose output, the prompt cache,
  is split like the one-pass prefill's (output bytes per chip at most 1.25x its). Catches a report that
  ignores the chunk, and the chunked cache left replicated over the batch axes (4x the bytes, as
  before core.laid_out_cache)."""
  small = ["mesh.fsdp=2", "mesh.expert=2", "rl.max_prompt_len=16", "model.max_seq_len=24"]
  whole = aot.compile_steps(_small(*small), "v5e:2x2", ["prefill"])[0]
  chunked = aot.compile_steps(_small(*small, "rl.prefill_chunk=4"), "v5e:2x2", ["prefill"])[0]
  assert chunked.fits is True and chunked.per_chip["temp"] != whole.per_chip["temp"]
  assert chunked.per_chip["output"] <= 1.25 * whole.per_chip["output"]


def test_decode_reports_the_host_tier_rows(aot):
  """rl.kv_host_bytes > 0: the decode report carries one paused row's bytes, equal to what the host
  tier measures on a real slot of the run's engine (rl/generation/tiers.HostTier.row_bytes), int8
  KV making it smaller, and the rows the budget holds, which scale with the budget; the JSON and
  the table have them; without a tier they are absent. Catches a row that forgets the int8 scales,
  the logits or a cache field, and a budget that is not read."""
  from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  from meshrl.rl.generation.tiers import HostTier  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.spec import make_generator  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  for kv in ("model", "int8"):
    cfg = _small("mesh.fsdp=4", "rl.kv_host_bytes=1000000", f"rl.kv_cache_dtype={kv}")
    gen = make_generator(cfg, None, stop_ids=(1,), pad_id=0)
    model = build_model(ModelConfig.from_config(cfg, None), None)
    _, params, extra = nnx.split(model, nnx.Param, ...)
    slots = gen.slot_engine(num_slots=2).empty((gen.prepare(params), extra, None), 2, model.config.vocab_size)
    want = HostTier.row_bytes(slots)
    figures = aot.host_tier_figures(cfg)
    assert figures["kv_host_row_bytes"] == want, kv
    assert figures["kv_host_rows"] == 1000000 // want
    bigger = aot.host_tier_figures(_small("rl.kv_host_bytes=8000000", f"rl.kv_cache_dtype={kv}"))
    assert bigger["kv_host_rows"] == 8000000 // want >= 8 * figures["kv_host_rows"]
    if kv == "model":
      full = want
  assert want < full  # int8 entries with their scales take fewer bytes
  cfg = _small("mesh.fsdp=4", "rl.kv_host_bytes=1000000")
  report = aot.compile_steps(cfg, "v5e:2x2", ["decode"])[0]
  assert (report.kv_host_bytes, report.kv_host_row_bytes) == (1000000, full)
  assert report.to_json()["kv_host_rows"] == 1000000 // full
  assert f"holds {1000000 // full} rows" in aot.markdown_table([report])
  assert aot.host_tier_figures(_small()) is None


def test_the_programs_are_built_from_the_given_model_numbers():
  """The AOT programs take the run's model numbers (rl/step/run_spec.model_numbers, built once by
  compile_steps, scripts/aot_compile.py and once per candidate by scripts/plan_layout.py) rather than
  building them from cfg again: numbers whose vocabulary differs from the config's are what the
  update, SFT, prefill, decode and host-tier figures hold. Fails if any of them rebuilt the model
  numbers from cfg. No libtpu: abstract programs on the CPU mesh, nothing compiled."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step import aot  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.run_spec import model_numbers  # pylint: disable=import-outside-toplevel
  from meshrl.sharding.mesh import make_mesh  # pylint: disable=import-outside-toplevel
  from meshrl.train.metrics import model_flops_per_token  # pylint: disable=import-outside-toplevel
  cfg = _small("mesh.fsdp=8", "rl.kv_host_bytes=1000000")
  mesh = make_mesh(cfg.mesh)
  numbers = model_numbers(cfg, mesh)
  extra = 64
  wider = dataclasses.replace(
      numbers, model=dataclasses.replace(numbers.model, vocab_size=numbers.model.vocab_size + extra),
      rollout_model=dataclasses.replace(numbers.rollout_model, vocab_size=numbers.rollout_model.vocab_size + extra))
  size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
  for step, mc, seq_len in (("update", wider.model, 16), ("sft", wider.model, cfg.data.seq_len)):
    plain, changed = aot.PROGRAMS[step](cfg, mesh), aot.PROGRAMS[step](cfg, mesh, wider)
    assert changed.model_flops == changed.tokens * model_flops_per_token(mc, seq_len=seq_len, training=True), step
    assert changed.model_flops > plain.model_flops and size(changed.args[0]) > size(plain.args[0]), step
  prefill = aot.prefill_program(cfg, mesh, wider)
  assert prefill.model_flops == prefill.tokens * model_flops_per_token(wider.rollout_model, seq_len=8, training=False)
  plain, decode = aot.decode_program(cfg, mesh), aot.decode_program(cfg, mesh, wider)
  assert decode.args[2].logits.shape[-1] == wider.rollout_model.vocab_size
  assert decode.host_tier["kv_host_row_bytes"] - plain.host_tier["kv_host_row_bytes"] == extra * 4  # f32 logits
