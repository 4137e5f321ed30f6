"""The run configuration: one dataclass per section (``schema``), presets and ``--section.key``
overrides (``load``), every key with its default and comment (``keys``), and the rules a config must
pass before any process starts (``validate``).

    cfg = load_config("debug", {"parallel.tp": 2}, world_size=2)   # raises ConfigError naming the rule
"""
from ndtrain.config.load import (
    CONFIG_DIR,
    apply_overrides,
    config_from_dict,
    did_you_mean,
    load_config,
    parse_cli_overrides,
    resolve_preset,
    save_config,
    validate,
)
from ndtrain.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    FinetuneConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
)
from ndtrain.errors import ConfigError

__all__ = ["CONFIG_DIR", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "FinetuneConfig",
           "LoggingConfig", "ModelConfig", "ParallelConfig", "TrainingConfig", "apply_overrides", "config_from_dict",
           "did_you_mean", "load_config", "parse_cli_overrides", "resolve_preset", "save_config", "validate"]
