"""The sampler program (one replica): leased prompts -> continuous batching (G samples
each) -> rewards -> buffer.

One process per replica (one host of a sampler slice on a pod; ``sampler.num_replicas``
processes on one machine), its own JAX runtime, mesh and engine::

    JetStream engine + continuous batching (rlflow.sampler.engine / batching)
    heartbeats to the learner from a background thread (rlflow.control.replicas)
    wait for the learner's first published version, load it
    loop:
        status to the learner's run control (rlflow.control.run_control): figures and the
          number of prompts wanted out; version / done / prompts leased by the learner's
          prompt ledger in (rlflow.control.ledger owns the prompt stream and applies one
          staleness budget to all replicas; in sync mode exactly learner.groups_per_step
          per version)
        newer version published -> a background thread pulls it (rlflow.exchange.transfer
          or the orbax folder) while decoding goes on, and the batcher swaps it in before
          its next decode step (sequences in flight continue under the new weights)
        one decode step; each finished group is handed to the reward workers
          (rlflow.data.rewarder, on this host) and decoding goes on; groups whose rewards
          are in go, whole and in the order they finished, to the learner's ring buffer
          (rlflow.exchange.buffer), tagged with their prompt's stream_index and lease_id
          (rlflow.sampler.delivery owns the leases in flight, the scoring and the delivery)

Multi-turn episodes (``env.name`` set, :mod:`rlflow.sampler.episodes`): each leased prompt
becomes ``G`` environments (reset here; the prompt ids are their first messages rendered by
the chat template), the batcher runs them as episodes (a slot parks while its environment
step runs in an environment worker), and a finished group goes to the buffer with the
environments' rewards and its ``loss_mask`` (no reward workers). A prompt whose environment
cannot be created or reset, or whose first messages render longer than
``sampler.max_prefill_length``, is dropped (logged, counted as ``sampler/env_reset_errors``,
reported to the ledger as dropped); environment step errors and timeouts end their episode
with reward 0 (counted). Neither stops the run unless ``env.max_consecutive_errors`` prompts
(or steps) in a row failed: then :class:`rlflow.envs.EnvFailureError` does.

The agent gateway (``gateway.enabled`` / ``gateway.agent``, :mod:`rlflow.sampler.program_gateway`):
OpenAI-compatible calls go through this batcher beside the rollouts (same slots, weight swaps
and policy versions); with ``gateway.agent`` each leased prompt becomes ``G`` agent sessions
instead of a request, and their episodes come back as the prompt's group (no reward workers:
the agent gives the reward).

Each request's seed comes with its lease (derived from the prompt's position in the prompt
stream), so a prompt re-dispatched to another replica, or after a resume, is drawn with the
same seed (its samples resume from the journal, :mod:`rlflow.sampler.journal_keeper`). A
group with a NaN/inf reward follows ``learner.on_bad_reward``: "drop" drops it (logged with
the function and sample, counted as ``sampler/dropped_bad_reward_groups``, and reported to
the ledger as dropped), "error" stops the run with that message. That error or
a prompt that fails at every retry (``MAX_PROMPT_RETRIES``) is reported to the learner
through the buffer (its next ``get_groups`` raises the message) and stops this program with
the error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace

import jax
import numpy as np

from rlflow.control import programs_common as pc
from rlflow.data.rewarder import Rewarder
from rlflow.envs.base import EnvFailureError
from rlflow.exchange.buffer import BufferClient
from rlflow.exchange.ring import BufferClosedError
from rlflow.exchange.wire import tcp_endpoint
from rlflow.mesh import make_mesh
from rlflow.models.hf import build_model
from rlflow.models.lora import LoraSpec
from rlflow.control.run_control import ControlClient
from rlflow.run.phases import report_phase
from rlflow.system.host_memory import release_freed_memory
from rlflow.sampler.background import Heartbeat, RateCounters, WeightPuller
from rlflow.sampler.batching import Request
from rlflow.sampler.delivery import GroupDelivery
from rlflow.sampler.journal_keeper import JournalKeeper
from rlflow.sampler.lanes import DecodeLanes, available_cpus, lane_count
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.lora_swap import AdapterApplier
from rlflow.data.reasoning import get_reasoning_parser
from rlflow.sampler.precision import sampler_model_config
from rlflow.sampler.program_gateway import GatewayHost
from rlflow.sampler.program_weights import SamplerError, WeightSwaps
from rlflow.sampler.sampling import SamplingParams
from rlflow.sampler.weight_pause import SwapPauseMeter

log = logging.getLogger("rlflow.sampler")

MAX_PROMPT_RETRIES = 2
IDLE_POLL_S = 0.005        # status poll period while waiting for weights or budget
BUSY_POLL_S = 0.1          # status poll period while decoding


def _endpoint(address: str) -> str:
    host, port = pc.split_address(address)
    return tcp_endpoint(host, port)


def replica_name(env=None) -> str:
    """``sampler-<i>``: ``RLFLOW_REPLICA`` (set by the launcher and the TPU scripts), else
    the host index in the slice."""
    env = os.environ if env is None else env
    return f"sampler-{env.get(pc.ENV_REPLICA, env.get(pc.ENV_PROCESS_ID, '0'))}"


def lease_cap(sampler_cfg, groups_per_step: int, num_replicas: int) -> int:
    """Most groups one replica holds leased at once: enough to keep its slots full twice
    over, and at least its share of one learner step."""
    per_fill = -(-sampler_cfg.num_slots // sampler_cfg.group_size)
    return max(2 * per_fill, -(-groups_per_step // max(1, num_replicas)))


class SamplerProgram(WeightSwaps, GatewayHost):
    """State of one sampler program (a thin shell over engine, batcher and clients)."""

    episodes = None          # the episode driver (env.name set), else None
    env_reset_errors = 0     # prompts dropped because their environments could not start
    env_reset_run = 0        # of them, since the last prompt whose environments started
    evals = None             # EvalRunner when eval.every_steps > 0
    journal = None           # JournalKeeper when sampler.journal_every_steps > 0
    _held_weights = None     # (version, params, pull_s) pulled while an evaluation decodes
    _trim_next_step = False  # a swap ran: trim the heap after the next step

    def __init__(self, cfg, endpoints: pc.Endpoints):
        self.cfg = cfg
        sc = cfg.sampler
        self.name = replica_name()
        self.cap = lease_cap(sc, cfg.learner.groups_per_step, sc.num_replicas)
        self.mesh = make_mesh(sc.mesh)
        engine_cfg = sampler_model_config(cfg)
        report_phase(f"loading the model ({cfg.model.path or 'built in'})")
        model, dcfg = build_model(engine_cfg, mesh=self.mesh)
        log.info("engine dtype %s, params %s (learner params %s, published in %s)",
                 engine_cfg.dtype, engine_cfg.param_dtype, cfg.model.param_dtype,
                 cfg.published_dtype)
        # LoRA: the learner publishes adapters only; the base is held here once
        self.adapters = None
        spec = LoraSpec.from_config(cfg.learner.lora)
        if spec is not None:
            self.adapters = AdapterApplier(model, dcfg, spec, cfg.learner.lora.swap, self.mesh)
        self.tokenizer = pc.run_tokenizer(cfg)
        self.reasoning = get_reasoning_parser(cfg.data.reasoning_parser,
                                              model_type=dcfg.model_type)
        eos = set(dcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        if cfg.env.enabled or cfg.gateway.on:    # turns stop on the template's end of turn
            from rlflow.envs.chat import ChatRenderer

            self.renderer = ChatRenderer(self.tokenizer)
            eos.update(self.renderer.end_of_turn_ids)
        engine_model = model if self.adapters is None else self.adapters.engine_model
        # with decode lanes the engine holds one lane's slots (rlflow.sampler.lanes)
        self.lanes = lane_count(sc.decode_lanes, sc.num_slots, hidden_size=dcfg.hidden_size,
                                backend=jax.default_backend(), cpus=available_cpus(),
                                replicas=sc.num_replicas,
                                multi_turn=cfg.env.enabled or cfg.gateway.on)
        log.info("decode lanes: %d of %d slots (sampler.decode_lanes=%d%s)", self.lanes,
                 sc.num_slots // self.lanes, sc.decode_lanes,
                 ", chosen by rlflow.sampler.lanes.lane_count" if sc.decode_lanes == 0 else "")
        lane_cfg = replace(sc, num_slots=sc.num_slots // self.lanes, decode_lanes=1,
                           num_pages=sc.num_pages // self.lanes)     # (paged: split too)
        # the engine keeps no weights of its own: every version comes from the learner
        self.engine = RlflowEngine(engine_model, lane_cfg, mesh=self.mesh,
                                   tokenizer_path=cfg.model.path, eos_token_ids=sorted(eos),
                                   keep_model_weights=False)
        coord = _endpoint(endpoints.coordinator)
        self.control = ControlClient(coord, consumer_id=self.name, instance=endpoints.instance,
                                     token=cfg.buffer.token, timeout_s=cfg.buffer.timeout_s)
        self.heartbeat = Heartbeat(ControlClient(
            coord, consumer_id=self.name, instance=endpoints.instance, token=cfg.buffer.token,
            timeout_s=cfg.buffer.timeout_s))
        self.subscriber = self._subscriber(coord, model)
        del model, engine_model      # the learner sends every version: free the loaded weights
        self.buffer = BufferClient.from_config(cfg.buffer, _endpoint(endpoints.buffer),
                                               name=self.name)
        self.episodes = self._episode_driver() if cfg.env.enabled else None
        self.env_reset_errors = 0
        self.env_reset_run = 0
        self.window = RateCounters(chips=self.mesh.devices.size)
        self.journal_on = cfg.sampler.journal_every_steps > 0
        self.delivery = GroupDelivery(
            self.tokenizer, self.buffer,
            None if self.episodes is not None or cfg.gateway.trains_agent else
            Rewarder(cfg.reward, plugins=cfg.plugins),
            self.window, on_bad_reward=cfg.learner.on_bad_reward, reasoning=self.reasoning,
            keep_sent=self.journal_on)
        self.prompts_started = 0
        self.journal = JournalKeeper.for_config(cfg, self.name)     # None: off
        # held-out evaluations (rlflow.sampler.eval_runner); pulled weights held back while
        # one decodes (one version per evaluation), under the lock with the puller thread
        if cfg.eval.enabled:
            from rlflow.sampler.eval_runner import EvalRunner

            self.evals = EvalRunner(cfg, self.tokenizer, self.reasoning)
        self._weights_lock = threading.Lock()
        self.swap = {"sync/pull_s": 0.0}
        self.pause = SwapPauseMeter()   # decode time lost per version (pull, cast, install)
        self.sleeping = False
        self.version = -1          # version of the weights new groups start with
        reply = self._status()
        report_phase("waiting for the learner's first weights")
        self.batcher = self._first_weights(reply)
        release_freed_memory()          # the start-up weights and the first pull's slices
        if self.journal is not None:    # a journal newer than a resumed learner's weights
            self.journal.forget_newer(self.version, reply.launch)
        self.puller = WeightPuller(self.subscriber, self._on_weights)
        if cfg.gateway.on:              # OpenAI-compatible calls through this batcher
            self._start_gateway()
        report_phase("compiling prefill and decode, then generating the first rollouts")

    def _episode_driver(self):
        from rlflow.sampler.env_workers import env_pool
        from rlflow.sampler.episodes import EpisodeDriver

        sc = self.cfg.sampler
        return EpisodeDriver(self.cfg.env, self.tokenizer, self.renderer,
                             pool=env_pool(self.cfg.env, self.cfg.plugins),
                             max_prompt_tokens=sc.max_prefill_length,
                             max_episode_tokens=self.cfg.env.episode_tokens(sc.max_tokens),
                             reasoning=self.reasoning)

    # ------------------------------------------------------------------ control
    def _status(self, want: int = 0):
        metrics = dict(self.window.figures(), **self.swap)
        pause = self.pause.metrics()
        metrics.update(pause)
        metrics["sync/sampler_pause_s"] = pause.get("sampler/weight_pause_s", 0.0)
        metrics["sampler/instance"] = float(self.control.instance)
        metrics.update(self.delivery.metrics())
        metrics.update(self.journal.metrics() if self.journal else {})
        if self.evals is not None:       # the held-out evaluations' reward failures
            metrics.update(self.evals.metrics())
        metrics.update(self._gateway_metrics())
        if self.episodes is not None:    # environments that raised or timed out: counted
            metrics.update(self.episodes.metrics())
            metrics["sampler/env_reset_errors"] = float(self.env_reset_errors)
            c = self.batcher.counters if hasattr(self, "batcher") else None
            # cut by the batcher (continuation past the limit) or the driver (messages too
            # long to render)
            metrics["sampler/episodes_cut_tokens"] += float(c.episodes_cut_tokens if c else 0)
        reply = self.control.status(
            version=self.version, prompts_started=self.prompts_started,
            want=want if self.version >= 0 else 0, metrics=metrics,
            dropped=self.delivery.take_dropped(),
            eval_results=self.evals.take_results() if self.evals is not None else ())
        if self.journal is not None:
            self.delivery.release_sent(reply.learner_version, self.cfg.runtime.max_staleness)
            if reply.prompts:            # prompts taken back from a replica: read again
                self.journal.refresh(reply.prompts, self.version)
        for element in reply.prompts:
            self._submit(element)
        if reply.eval_version >= 0 and self.evals is not None and not self.evals.busy \
                and hasattr(self, "batcher"):
            self._start_eval(reply.eval_version)
        return reply

    def _want(self) -> int:
        return max(0, self.cap - len(self.delivery.in_flight))

    def _submit(self, element) -> None:
        # The seed comes with the lease: derived by the ledger from the element's position
        # in the prompt stream, not its prompt_id, so a prompt met again in a later epoch
        # gets new random draws, and a re-dispatched or resumed one the same draws.
        if self.rollouts is not None:            # agent sessions through the gateway
            return self._submit_sessions(element)
        seed = int(element["seed"])
        sampling = SamplingParams.from_config(self.cfg.sampler, seed=seed)
        prompt, episode = np.asarray(element["prompt_tokens"], np.int32), None
        if self.episodes is not None:
            got = self._new_episodes(element, sampling)
            if got is None:
                return
            prompt, episode, sampling = got
        request = Request(prompt_id=int(element["prompt_id"]), prompt_tokens=prompt,
                          num_samples=self.cfg.sampler.group_size, sampling=sampling,
                          episode=episode)
        resumed = self.journal.resumed(element, request, self.version) if self.journal else ()
        for attempt in range(MAX_PROMPT_RETRIES + 1):
            try:
                self.batcher.submit(request, resumed)
                break
            except Exception as e:  # noqa: BLE001 - reported below with the prompt id
                named = f"prompt_id {request.prompt_id}: "
                why = str(e).removeprefix(named)       # the batcher's errors name it too
                if attempt == MAX_PROMPT_RETRIES:
                    raise SamplerError(f"prompt_id {request.prompt_id} failed "
                                       f"{MAX_PROMPT_RETRIES + 1} times: {why}") from e
                log.warning("%s%s (retrying)", named, why)
        self.delivery.admit(request, element)
        self.prompts_started += 1

    def _new_episodes(self, element, sampling):
        """``(prompt ids, episode group, sampling)`` for a leased prompt, or None when its
        environments cannot be created (the prompt is dropped, logged and counted).

        Raises:
          rlflow.envs.EnvFailureError: this is the ``env.max_consecutive_errors``-th prompt
            in a row whose environments could not start.
        """
        from rlflow.sampler.episodes import episode_record, sampling_for_episodes

        limit = self.cfg.sampler.max_prefill_length
        try:
            prompt, group = self.episodes.new_group(episode_record(element),
                                                    self.cfg.sampler.group_size)
            if prompt.size > limit:      # never cut: the system turn comes first
                raise ValueError(f"the rendered first messages are {prompt.size} tokens, "
                                 f"longer than sampler.max_prefill_length={limit}")
        except Exception as e:  # noqa: BLE001 - a bad record never stops the run ...
            self.env_reset_errors += 1
            self.env_reset_run += 1
            self.delivery.drop(element)
            log.warning("prompt_id %d: environment %r could not start (%s: %s); the prompt "
                        "is dropped (%d so far)", int(element["prompt_id"]), self.cfg.env.name,
                        type(e).__name__, e, self.env_reset_errors)
            most = self.cfg.env.max_consecutive_errors
            if most and self.env_reset_run >= most:          # ... a broken environment does
                raise EnvFailureError(
                    f"environment {self.cfg.env.name!r} could not start for the last "
                    f"{self.env_reset_run} prompts in a row (env.max_consecutive_errors="
                    f"{most}), the last prompt_id {int(element['prompt_id'])}: "
                    f"{type(e).__name__}: {e}. Fix the environment or the data (or raise the "
                    f"limit; 0: never stop)") from e
            return None
        self.env_reset_run = 0
        return prompt, group, sampling_for_episodes(sampling, self.cfg.env,
                                                    self.cfg.sampler.max_tokens,
                                                    self.renderer.end_of_turn_ids)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        sync_sleep = self.cfg.runtime.sampler_sleep
        last_status = 0.0
        reply = None
        status_version = self.version
        while True:
            pc.raise_if_stopped()               # a stop whose exception a finaliser dropped
            now = time.monotonic()
            busy = self.batcher.has_work
            want = self._want()
            # more prompts may be leased now: budget left at the last reply, or new weights
            leasable = want > 0 and reply is not None and (
                reply.budget > 0 or self.version != status_version)
            if reply is None or leasable or \
                    now - last_status >= (BUSY_POLL_S if busy else IDLE_POLL_S):
                status_version = self.version
                reply = self._status(want)      # also leases up to `want` prompts
                last_status = time.monotonic()
                if reply.done:
                    log.info("the learner is done (version %d); stopping", reply.learner_version)
                    return
                if reply.published_version > self.version and self._held_weights is None:
                    self.puller.request()
            self.puller.check()
            self._gateway_step()
            if self.evals is not None:
                self.evals.collect()
            try:
                self.delivery.collect()
            except BufferClosedError:
                log.info("the learner closed the buffer: the run is ending; stopping")
                return
            if not self.batcher.has_work:
                if self.delivery.waiting_for_rewards:   # only rewards pending: wait
                    t0 = time.monotonic()
                    try:
                        self.delivery.collect(IDLE_POLL_S)
                    except BufferClosedError:
                        log.info("the learner closed the buffer: the run is ending; stopping")
                        return
                    self.window.add(idle=time.monotonic() - t0)
                    continue
                if sync_sleep and not self.sleeping:
                    self.batcher.reset_cache()      # free the KV cache while waiting
                    self.sleeping = True
                time.sleep(IDLE_POLL_S)
                self.window.add(idle=IDLE_POLL_S)
                continue
            self.sleeping = False
            c = self.batcher.counters
            used, avail, swaps = c.slot_steps_used, c.slot_steps_available, c.weight_swaps
            t0 = time.monotonic()
            groups = self._gateway_take(self.batcher.step())
            swapped = c.weight_swaps > swaps
            self.pause.step(t0, time.monotonic(),
                            swapped_to=self.batcher.version if swapped else None)
            if self._trim_next_step:     # the previous step's swap: the old version is freed
                release_freed_memory()
            self._trim_next_step = swapped
            if self.evals is not None and groups:
                groups = self.evals.take(groups)
                self._release_held_weights()
            if groups:
                self.delivery.score(groups)
            if self.journal is not None:   # (after score: a finished group is journaled)
                self.journal.after_step(self.batcher, self.delivery.in_flight,
                                        self.delivery.held())
            self.window.add(tokens=c.slot_steps_used - used, slots_used=c.slot_steps_used - used,
                            slots_total=c.slot_steps_available - avail)

    def report(self, message: str) -> None:
        try:
            self.buffer.report_error(message, timeout=5.0)
        except Exception as e:  # noqa: BLE001 - the learner may be gone already
            log.warning("could not report the failure to the learner: %s", e)

    def close(self) -> None:
        closers = [self._close_gateway, self.heartbeat.close, self.control.close, self.buffer.close,
                   self.subscriber.close]
        closers += [x.close for x in (self.delivery, self.episodes, self.evals)
                    if x is not None]
        if hasattr(self, "puller"):
            closers.insert(0, self.puller.close)
        if isinstance(getattr(self, "batcher", None), DecodeLanes):
            closers.append(self.batcher.close)
        for closer in closers:
            try:
                closer()
            except Exception as e:  # noqa: BLE001
                log.warning("closing: %s", e)


def main(cfg, endpoints: pc.Endpoints) -> None:
    """Run the sampler program until the learner says the run is done.

    Raises:
      SamplerError: a prompt failed at every retry.
      rlflow.data.rewards.NonFiniteRewardError: a reward function returned NaN/inf and
        ``learner.on_bad_reward="error"``.
      rlflow.data.rewards.RewardFunctionError: a reward function failed on
        ``reward.max_consecutive_errors`` calls in a row.
      rlflow.envs.EnvFailureError: ``env.max_consecutive_errors`` prompts (or environment
        steps) in a row failed.
      rlflow.exchange.ring.BufferTimeoutError / rlflow.exchange.wire.PeerTimeoutError: the
        learner stopped answering.
    """
    program = SamplerProgram(cfg, endpoints)
    try:
        program.run()
    except pc.Stopped:
        raise
    except Exception as e:
        program.report(f"{type(e).__name__}: {e}")
        raise
    finally:
        program.close()
