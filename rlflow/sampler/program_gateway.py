"""The sampler program's gateway half (``gateway.enabled`` or ``gateway.agent``, issue 52):
the OpenAI-compatible server, its calls through this replica's batcher, and (with
``gateway.agent``) leased prompts run as agent sessions (:mod:`rlflow.gateway`).

A part of :class:`rlflow.sampler.program.SamplerProgram`: :meth:`GatewayHost._start_gateway`
after the first weights; :meth:`GatewayHost._gateway_step` at the top of every loop turn
(queued calls into the batcher; groups whose sessions all closed to the delivery);
:meth:`GatewayHost._gateway_take` on what ``batcher.step()`` returns (the calls' own groups
answer their HTTP requests). The key is the run's ``RLFLOW_GATEWAY_KEY`` when set (external
agents need it), else a fresh random one held in memory and handed to the agent runner in
its environment only.
"""

from __future__ import annotations

import logging
import os
import secrets

log = logging.getLogger("rlflow.sampler")

ENV_GATEWAY_KEY = "RLFLOW_GATEWAY_KEY"


class GatewayHost:
    """Mixed into the sampler program (uses ``cfg``, ``tokenizer``, ``renderer``,
    ``reasoning``, ``engine``, ``batcher``, ``delivery``)."""

    gateway = None        # rlflow.gateway.service.Gateway
    gateway_server = None
    gateway_calls = None
    rollouts = None       # GatewayRollouts when gateway.agent is set
    agent_runner = None   # the runner process
    agent_restarts = 0

    def _start_gateway(self) -> None:
        from rlflow.gateway.calls import CallQueue
        from rlflow.gateway.rollouts import GatewayRollouts
        from rlflow.gateway.server import GatewayServer
        from rlflow.gateway.service import Gateway
        from rlflow.gateway.sessions import SessionStore
        from rlflow.sampler.sampling import SamplingParams

        g, sc = self.cfg.gateway, self.cfg.sampler
        store = SessionStore(self.renderer, max_prompt_tokens=sc.max_prefill_length,
                             max_episode_tokens=sc.max_tokens, max_call_tokens=sc.max_tokens)
        self.gateway_calls = CallQueue()
        self.gateway = Gateway(store, self.gateway_calls, SamplingParams.from_config(sc),
                               tool_parser=g.tool_parser,
                               reasoning=self.reasoning if self.cfg.data.reasoning_parser
                               != "none" else None, call_timeout_s=g.call_timeout_s,
                               max_n=g.max_n, model_name=self.cfg.name)
        if g.trains_agent:
            self.rollouts = GatewayRollouts(self.gateway, sc.group_size, sc.max_tokens,
                                            g.session_timeout_s)
        self._gateway_key = os.environ.get(ENV_GATEWAY_KEY) or secrets.token_urlsafe(24)
        replica = int(self.name.rsplit("-", 1)[-1]) if self.name[-1:].isdigit() else 0
        self.gateway_server = GatewayServer(
            self.gateway, self._gateway_key, host=g.host,
            port=g.port + replica if g.port else 0, max_request_bytes=g.max_request_bytes,
            next_session=self.rollouts.next_session if self.rollouts else None)
        log.info("%s: agent gateway at %s/v1 (sessions: %s/s/<session>/v1)", self.name,
                 self.gateway_server.base_url, self.gateway_server.base_url)
        if g.trains_agent:
            self._start_runner()

    def _start_runner(self) -> None:
        from rlflow.gateway.agents import start_runner

        g = self.cfg.gateway
        self.agent_runner = start_runner(self.gateway_server.base_url, self._gateway_key,
                                         g.agent, g.agent_threads)

    def _submit_sessions(self, element) -> None:
        """A leased prompt -> ``G`` agent sessions (in flight in the delivery's leases)."""
        from rlflow.sampler.episodes import episode_record

        request = self.rollouts.admit(int(element["prompt_id"]), episode_record(element))
        self.delivery.admit(request, element)
        self.prompts_started += 1

    def _gateway_step(self) -> None:
        if self.gateway_calls is None:
            return
        self.gateway_calls.pump(self.batcher)
        if self.rollouts is None:                 # external sessions only: expire idle ones
            for s in self.gateway.store.idle(self.cfg.gateway.session_timeout_s):
                self.gateway.end(s, error="expired", status="expired")
            return
        if self.agent_runner is not None and self.agent_runner.poll() is not None:
            self.agent_restarts += 1
            log.warning("the agent runner exited with code %s; restarting it (%d restarts)",
                        self.agent_runner.returncode, self.agent_restarts)
            self._start_runner()
        groups, dropped = self.rollouts.poll()
        for request in dropped:
            element = self.delivery.in_flight.pop(id(request))
            self.delivery.drop(element)
        if groups:
            self.delivery.score(groups)

    def _gateway_take(self, groups) -> list:
        return groups if self.gateway_calls is None else self.gateway_calls.take(groups)

    @property
    def gateway_busy(self) -> bool:
        """Gateway calls are queued or decoding."""
        return self.gateway_calls is not None and self.gateway_calls.in_flight > 0

    def _gateway_metrics(self) -> dict:
        if self.gateway is None:
            return {}
        out = self.gateway.store.metrics()
        if self.rollouts is not None:
            out.update(self.rollouts.metrics())
            out["gateway/agent_restarts"] = float(self.agent_restarts)
        return out

    def _close_gateway(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()
        if self.agent_runner is not None and self.agent_runner.poll() is None:
            self.agent_runner.terminate()
            try:
                self.agent_runner.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a runner that ignores TERM
                self.agent_runner.kill()
        if self.gateway_server is not None:
            self.gateway_server.close()
        if self.gateway_calls is not None:
            self.gateway_calls.close()
