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
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
