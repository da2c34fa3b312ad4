"""moe-train: the ``moe-train`` CLI, experiment config, data, optimizer, trainer loop, checkpoints, metrics."""

from moe_train.config import (
    ConfigError,
    DataConfig,
    ExperimentConfig,
    PeftConfig,
    RunConfig,
    TrainConfig,
    load_config,
    preset_names,
)

__version__ = "0.20.0"

__all__ = [
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "PeftConfig",
    "RunConfig",
    "TrainConfig",
    "__version__",
    "load_config",
    "preset_names",
]
