"""Multi-turn environments: the protocol and registry (:mod:`rlflow.envs.base`), token
rendering with the chat template (:mod:`rlflow.envs.chat`), the built-in environments
(``guess_digit``, ``gsm8k_calculator``) and the sandboxed Python tool."""

from rlflow.envs.base import (EnvError, EnvFailureError, EnvStep, Environment, Message,
                              get_environment, register_environment, registered_environments)
from rlflow.envs.chat import ChatRenderer, ChatTemplateError, check_messages, episode_mask

__all__ = ["ChatRenderer", "ChatTemplateError", "EnvError", "EnvFailureError", "EnvStep",
           "Environment", "Message",
           "check_messages", "episode_mask", "get_environment", "register_environment",
           "registered_environments"]
