"""The agent gateway (issue 52): an OpenAI-compatible endpoint in each sampler replica that
records agent sessions as episodes (:mod:`rlflow.gateway`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.config.validation import _check, _positive, _timeout, _finite_floats

TOOL_PARSERS = ("hermes", "llama3", "none")


@dataclass(frozen=True)
class GatewayConfig:
    """The sampler's OpenAI-compatible gateway.

    With ``agent`` set, the run trains an agent program through the gateway: each leased
    prompt becomes ``sampler.group_size`` sessions run by the agent runner
    (:mod:`rlflow.gateway.agents`), and a prompt's group record is built from its sessions'
    episodes (token ids the sampler generated, behaviour logprobs, policy versions, loss mask
    1 on sampled tokens only) and rewards. Reward functions (``reward.functions``) are not
    used: the agent returns (or posts) the reward.

    Attributes:
      enabled: serve the gateway (``agent`` set turns it on too).
      host: the address it binds (the launcher's choice; default loopback).
      port: its port on replica 0 (replica ``i`` takes ``port + i``); 0: a free port, logged.
      agent: ``"module:function"`` / ``"path/to/file.py:function"``: the agent function
        ``(client: openai.OpenAI, task: dict) -> reward`` run once per session; "" (default):
        serve external agents only (no training through the gateway).
      agent_threads: sessions the agent runner runs at once (>= 1).
      tool_parser: the model's tool-call format: "hermes" (Qwen, Hermes ``<tool_call>``),
        "llama3" (JSON tool calls), "none", or ``"module:function"``
        (``text -> (content, [(name, arguments dict)], bad blocks)``).
      session_timeout_s: a session with no call for this long expires (reward 0, marked
        failed, counted ``gateway/sessions_expired``).
      call_timeout_s: longest wait of one call for the sampler (504 past it).
      max_request_bytes: largest request body (413 past it).
      max_n: most choices (``n``) per call.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    agent: str = ""
    agent_threads: int = 8
    tool_parser: str = "hermes"
    session_timeout_s: float = 300.0
    call_timeout_s: float = 300.0
    max_request_bytes: int = 8 << 20
    max_n: int = 8

    def __post_init__(self):
        _finite_floats(self, "gateway")
        _check(0 <= self.port < 65536, "gateway.port", f"must be in [0, 65535], got {self.port}")
        _check(isinstance(self.host, str) and self.host != "", "gateway.host",
               f"must be an address to bind, got {self.host!r}")
        _positive(self.agent_threads, "gateway.agent_threads")
        _check(self.tool_parser in TOOL_PARSERS or ":" in self.tool_parser,
               "gateway.tool_parser", f"must be one of {list(TOOL_PARSERS)} or "
               f"'module:function', got {self.tool_parser!r}")
        _timeout(self.session_timeout_s, "gateway.session_timeout_s")
        _timeout(self.call_timeout_s, "gateway.call_timeout_s")
        _positive(self.max_request_bytes, "gateway.max_request_bytes")
        _positive(self.max_n, "gateway.max_n")

    @property
    def on(self) -> bool:
        """Whether the sampler serves the gateway."""
        return self.enabled or bool(self.agent)

    @property
    def trains_agent(self) -> bool:
        """Whether leased prompts are run as agent sessions."""
        return bool(self.agent)
