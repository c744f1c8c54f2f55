"""Experiment configuration: frozen, typed dataclasses validated at construction.

One :class:`ExperimentConfig` describes a whole run. It is built by a Python file in
``configs/`` (a function ``config() -> ExperimentConfig``) and overridden from the
command line with tyro (``rlflow train --config configs/x.py --learner.lr 1e-6``).

Every dataclass checks itself in ``__post_init__``; a bad value raises
:class:`ConfigError` whose message names the field (``learner.lr``) and what was
expected. Nested sections are checked when they are built, so a bad combination fails
before any device work starts (the pattern of Tunix's typed configs).
"""

from rlflow.config.validation import DTYPES, ConfigError
from rlflow.config.model import ModelConfig, MeshConfig
from rlflow.config.served_reward import HttpRewardConfig, JudgeConfig, ServedRewardConfig
from rlflow.config.data import DataConfig, RewardConfig
from rlflow.config.sampler import SamplerConfig
from rlflow.config.envs import EnvConfig
from rlflow.config.gateway import GatewayConfig
from rlflow.config.eval import EvalConfig
from rlflow.config.teacher import TeacherConfig
from rlflow.config.learner import LORA_PROJECTIONS, LoraConfig, LearnerConfig
from rlflow.config.rollout_correction import RolloutCorrectionConfig
from rlflow.config.runtime import (BufferConfig, RuntimeConfig, CheckpointConfig, MetricsConfig,
                                   WandbConfig)
from rlflow.config.experiment import ExperimentConfig, config_module, replace, load_config_file

__all__ = [
    "ConfigError",
    "DTYPES",
    "ModelConfig",
    "MeshConfig",
    "DataConfig",
    "RewardConfig",
    "ServedRewardConfig",
    "HttpRewardConfig",
    "JudgeConfig",
    "SamplerConfig",
    "EnvConfig",
    "GatewayConfig",
    "EvalConfig",
    "TeacherConfig",
    "LORA_PROJECTIONS",
    "LoraConfig",
    "LearnerConfig",
    "RolloutCorrectionConfig",
    "BufferConfig",
    "RuntimeConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "WandbConfig",
    "ExperimentConfig",
    "replace",
    "load_config_file",
    "config_module",
]
