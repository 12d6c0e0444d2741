"""Prints the resolved config, its difference from base, and the mesh it would build; then exits.

  python scripts/show_config.py --config=configs/tiny.py --config.model.num_layers=4
  python scripts/show_config.py --cpu_devices=8 --config=configs/tiny.py --config.mesh.fsdp=4 \
      --config.mesh.tensor=2
"""

import sys

from meshrl.configs import cli, config_diff, load_preset


def main(argv):
  args, config = cli.parse(argv, description=__doc__)
  import jax  # pylint: disable=import-outside-toplevel  (after --cpu_devices)
  from meshrl.sharding import make_mesh  # pylint: disable=import-outside-toplevel
  try:
    mesh = make_mesh(config.mesh)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  print(f"# resolved config ({args.config})")
  print(config.to_json_best_effort(indent=2, sort_keys=True))
  diff = config_diff(config, load_preset("base"))
  print("\n# differences from configs/base.py")
  for key, (base_value, value) in sorted(diff.items()):
    print(f"  {key}: {base_value!r} -> {value!r}")
  if not diff:
    print("  (none)")
  devices = mesh.devices.flatten()
  print(f"\n# mesh over {devices.size} {devices[0].platform} device(s) of {jax.device_count()}")
  for axis, size in mesh.shape.items():
    print(f"  {axis:>8}: {size}")
  print(f"  device ids by position: {mesh.device_ids.flatten().tolist()}")
  try:
    print_dispatch_plan(config, mesh)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


def print_dispatch_plan(config, mesh) -> None:
  """Which expert dispatch each phase of an RL step runs (moe.dispatch=auto picks per backend/phase).

  Token counts per call are the global ones the MoE layer sees under jit: decode = prompts x samples
  rows of one token, prefill = prompts x max_prompt_len (a group shares its prompt's prefill),
  train = rows x (prompt + response) per minibatch.
  """
  # pylint: disable=import-outside-toplevel
  from meshrl.model import moe, moe_dispatch
  from meshrl.train.init_from import model_config
  from meshrl.sharding.mesh import EXPERT_AXIS, axis_size, platform
  # pylint: enable=import-outside-toplevel
  mc = model_config(config, mesh)  # also checks moe.dispatch and moe.capacity_factor
  if not mc.num_moe_layers:
    return
  rl = config.rl
  rows = rl.prompts_per_step * rl.group_size
  tokens = {"train": rows * (rl.max_prompt_len + rl.max_new_tokens) // max(rl.num_minibatches, 1),
            "prefill": rl.prompts_per_step * rl.max_prompt_len, "decode": rows}
  backend = platform(mesh)
  print(f"\n# moe dispatch: {mc.dispatch} on {backend}")
  if axis_size(mesh, EXPERT_AXIS) > 1:
    dropping = " (drops overflow)" if mc.dispatch == "capacity" else ""
    print(f"  every phase: expert_parallel all-to-all over {axis_size(mesh, EXPERT_AXIS)} devices{dropping}")
    print(f"  expert weights (moe.ep_weights={mc.ep_weights}; bytes each layout moves or holds beyond "
          f"the other, per device per call: expert_parallel.ep_weight_bytes):")
    for phase, (layout, cost) in moe.ep_weights_plan(mc, mesh, tokens).items():
      print(f"  {phase:>8}: {layout} ({tokens[phase]} tokens per call; sharded "
            f"{cost['sharded'] / 2 ** 20:.3g} MiB, gathered {cost['gathered'] / 2 ** 20:.3g} MiB)")
    return
  chosen = moe_dispatch.plan(mc.dispatch, backend=backend, k=mc.num_experts_per_tok,
                             num_experts=mc.num_experts, tokens_by_phase=tokens)
  for phase, name in chosen.items():
    print(f"  {phase:>8}: {name} ({tokens[phase]} tokens per call)")


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
