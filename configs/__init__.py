"""Config loading for scripts and notebooks: one loader, one override syntax.

  cfg = meshrl.configs.load("configs/tiny.py", overrides=["model.num_layers=4"])

is what `--config=configs/tiny.py --config.model.num_layers=4` does in every script.
"""

from meshrl.configs.loader import (
    ConfigError,
    apply_overrides,
    config_diff,
    load,
    load_preset,
    preset_path,
    save_config,
)
