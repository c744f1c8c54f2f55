"""Multi-turn environments: the protocol and registry (:mod:`rlflow.envs.base`)."""

from rlflow.envs.base import (EnvError, EnvStep, Environment, Message, get_environment,
                              register_environment, registered_environments)

__all__ = ["EnvError", "EnvStep", "Environment", "Message", "get_environment",
           "register_environment", "registered_environments"]
