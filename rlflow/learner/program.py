"""The learner program: pulls rollout groups, trains, publishes weights, writes the run folder.

One process, its own JAX runtime and mesh (with ``learner.num_hosts > 1``: host 0 of the
learner's hosts, which follow its commands and serve their own weight shards,
:mod:`rlflow.learner.hosts`)::

    build model + train state on the mesh (rlflow.learner.trainer.Learner)
    resume from <run>/checkpoints when there is one (rlflow.checkpoint)
    the prompt ledger (rlflow.control.ledger): the prompt stream (rlflow.data.pipeline),
      restored from the checkpoint with the prompts admitted but not yet trained
    serve the ring buffer (rlflow.exchange.buffer) and the coordinator (run control,
      prompt leases, replica heartbeats, weight offers: rlflow.control.run_control); publish v0
    for each step:
        take learner.groups_per_step groups from the buffer (those taken while the step
          before ran first, see below); a group whose every sample is
          older than runtime.max_staleness versions (stale_policy "drop"), or that has no
          reward variance under learner.dynamic_sampling, is rejected and counted, and the
          sampler makes a replacement (see rlflow.control.run_control)
        build the batch; when it has no loss sample (all masked / stale / filtered / bad
          rewards) the step is skipped: counted, nothing trained or published, its groups
          given back to the admission budget (rlflow.learner.skips)
        dispatch the jitted step                      -> version v + 1 (= steps taken)
        while it runs: take the next step's groups already waiting in the buffer, judged
          against version v + 1, and build and check its batch when they are all there
          (LearnerProgram.prefetch, rlflow.learner.prefetch)
        publish every runtime.publish_every steps (rlflow.learner.publish); log one metrics
          record (rlflow.run.metrics);
        write sample completions and the step's prompts (trained_prompts.jsonl);
        log the held-out evaluations finished meanwhile (rlflow.control.evals);
        checkpoint every checkpoint.every_steps (with the ledger)
    save the exit checkpoint; wait (at most eval.timeout_s) for the evaluations still
    running; tell the samplers the run is done.

While it waits for groups the learner checks that they can still come: the prompt stream
must hold enough prompts (``PromptsExhaustedError``) and some sampler replica must be alive
(``NoReplicaError`` after ``runtime.replica_timeout_s``).

Metrics of one step come from the batch (rewards, lengths, staleness of every consumed
sample), the step (loss, KL, entropy, clipping, importance weights), the buffer (fill,
waits), the sampler's latest status (tokens/s, slot occupancy, idle time, swap pause) and
the learner's own clock (step time, idle fraction, publish-to-swap time).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from rlflow import checkpoint as ckpt_lib
from rlflow.control import programs_common as pc
from rlflow.exchange.buffer import BufferServer
from rlflow.data.reasoning import get_reasoning_parser
from rlflow.exchange.records import completion_samples, policy_version_range
from rlflow.exchange.ring import RingBuffer
from rlflow.learner.intake import GroupIntake
from rlflow.learner.publish import Publisher, keeps_params
from rlflow.learner.skips import FilterStreak, SkipCounter, skip_reason
from rlflow.learner.trainer import Learner, pull_metrics
from rlflow.run.metrics import MetricsWriter
from rlflow.run.phases import report_phase
from rlflow.run.report import make_report
from rlflow.control.ledger import PromptLedger, TrainedPromptsLog
from rlflow.control.replicas import ReplicaTable
from rlflow.control.run_control import RunCoordinator
from rlflow.control.evals import RunEvals
from rlflow.control.seeds import derive_seed

log = logging.getLogger("rlflow.learner")
# build_batch info not written to metrics.jsonl (see LearnerProgram._step_and_record).
UNLOGGED_BATCH_INFO = frozenset({"batch/dropped_bad_reward_groups"})

DONE_GRACE_S = 10.0   # seconds the learner waits for the samplers to see "done"


class LearnerProgram(GroupIntake):
    """State of one learner program (a thin shell; the math lives in rlflow.learner.*; taking
    the groups of each step: :class:`rlflow.learner.intake.GroupIntake`)."""

    hosts = None    # LearnerHosts when learner.num_hosts > 1 (this is host 0), set in __init__
    evals: RunEvals | None = None   # eval.every_steps > 0: the held-out evaluations
    _stepped = False                # a step was taken (its compile phase reported)

    def __init__(self, cfg, endpoints: pc.Endpoints):
        from rlflow.control.replica_metrics import StepRates

        self.cfg = cfg
        self.rates = StepRates(time.time())    # sampler rates over each step, the run
        if "://" not in cfg.run_path:
            # A run folder holds one run: what rlflow train checked, checked again for a
            # learner started without it (scripts/tpu); idempotent after the launcher.
            from rlflow.run.identity import prepare_run_folder

            prepare_run_folder(cfg)
        self.gps = cfg.learner.groups_per_step
        report_phase(f"loading the model ({cfg.model.path or 'built in'}) and the optimizer "
                     "state")
        self.tokenizer = pc.run_tokenizer(cfg)
        self.learner = Learner(cfg, keep_params=keeps_params(cfg),
                               student_tokenizer=self.tokenizer)
        self.checkpointer = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(cfg.run_path),
                                                  cfg.checkpoint)
        self.start_step, data_state, extra = self._resume()
        self.version = self.start_step
        # Every step accepts exactly groups_per_step groups, so the admission count of a
        # resumed run starts where the checkpointed one stopped.
        # (A skipped step gives its groups back, so this holds with skips too.)
        self.counts = dict(accepted=self.start_step * self.gps, stale_groups=0,
                           zero_variance_groups=0)
        self.skips = SkipCounter(cfg)
        if self.start_step and "run_totals" not in extra:
            log.warning("checkpoint step %d was written before checkpoints kept the run's "
                        "totals: learner/stale_groups_dropped, zero_variance_groups_dropped "
                        "and skipped_steps count from 0 again", self.start_step)
        self.restore_totals(extra.get("run_totals", {}))
        self.filter_streak = FilterStreak(cfg)
        # the samples log splits a thinking model's completions as the rewards saw them
        self.reasoning = get_reasoning_parser(cfg.data.reasoning_parser,
                                              model_type=self.learner.model_config.model_type)
        self.threshold = pc.accuracy_threshold(cfg.reward)
        self.ledger = self._ledger(data_state)
        self.batch_keys: list = []           # ledger keys of the groups of the current batch
        self.steps_marked = self.start_step  # steps whose groups the ledger counts trained
        self.trained_log = TrainedPromptsLog(cfg.run_path, self.start_step)
        self.writer = MetricsWriter.for_experiment(cfg, start_step=self.start_step,
                                                   report_plots=make_report)
        self.evals = RunEvals.for_experiment(cfg, self.tokenizer, self.writer, self.start_step)
        bhost, bport = pc.split_address(endpoints.buffer)
        self.buffer = BufferServer(RingBuffer.from_config(cfg.buffer), bind_address=bhost,
                                   port=bport, token=cfg.buffer.token,
                                   group_size=cfg.sampler.group_size,
                                   max_tokens=cfg.sampler.max_tokens,
                                   on_arrival=self._arrived, on_discard=self._discarded).start()
        chost, cport = pc.split_address(endpoints.coordinator)
        self.publisher = Publisher(cfg, chost,  # rlflow.learner.publish
                                   params_kept=self.learner.keeps_params)
        self.hosts = None       # learner.num_hosts > 1: this is host 0 (rlflow.learner.hosts)
        if cfg.learner.num_hosts > 1:
            from rlflow.learner.hosts import LearnerHosts

            self.hosts = self.publisher.hosts = LearnerHosts(
                cfg, chost, self.publisher.impl, offers=self.publisher.offers)
        self.coordinator = RunCoordinator(
            self.publisher.offers, buffer_counts=self._buffer_counts, ledger=self.ledger,
            replicas=ReplicaTable(cfg.runtime.replica_timeout_s, time.monotonic()),
            bind_address=chost, port=cport, token=cfg.buffer.token,
            evals=self.evals.schedule if self.evals is not None else None)
        if self.hosts is not None:
            self.coordinator.weight_hosts = self.hosts.weight_hosts
        self.coordinator.start()
        self._publish()
        self._last_buffer = self.buffer.metrics()
        log.info("learner ready at version %d: buffer %s, coordinator %s", self.version,
                 self.buffer.address, self.coordinator.address)
        report_phase(f"waiting for the first rollouts ({self.gps} groups of "
                     f"{cfg.sampler.group_size})")

    # ------------------------------------------------------------------ set-up pieces
    def _resume(self):
        if self.cfg.checkpoint.resume == "never" and self.checkpointer.latest_step() is not None:
            # rlflow train moved an earlier run aside (or refused) before starting this
            # program; here (e.g. started by the TPU scripts) a folder is never mixed.
            from rlflow.run.identity import RunFolderConflict

            raise RunFolderConflict(
                f"run folder {self.cfg.run_path} holds an earlier run's checkpoints (steps "
                f"{self.checkpointer.all_steps()}); checkpoint.resume='never' will not mix two "
                "runs in one folder: pick a new --name / --run_dir or remove them")
        restored = self.learner.resume(self.checkpointer)   # PPO: with its value head
        if restored is None:
            return 0, None, {}
        log.info("resumed from checkpoint step %d", restored.step)
        return restored.step, restored.data_state, dict(restored.extra or {})

    def _ledger(self, data_state) -> PromptLedger:
        """The prompt ledger over the run's prompt stream, restored from the checkpoint."""
        from rlflow.data.pipeline import prompt_dataset

        ds, stats = prompt_dataset(self.cfg.data, self.tokenizer, seed=self.cfg.seed)
        log.info("%s", stats.summary())
        self.prompts_per_epoch = stats.num_kept
        # the pre-scan's counts, for the metrics and the launcher's console
        self.prompt_counts = {"sampler/prompts_kept": float(stats.num_kept),
                              "sampler/prompts_too_long": float(stats.num_too_long),
                              "sampler/prompts_bad": float(stats.num_bad)}
        ledger = PromptLedger(
            ds.__getitem__, len(ds) if self.cfg.data.num_epochs > 0 else None,
            groups_per_step=self.gps, max_staleness=self.cfg.runtime.max_staleness,
            seed_of=lambda i: derive_seed(self.cfg.sampler.seed, i),
            trained_groups=self.start_step * self.gps)
        ledger.restore(data_state)
        return ledger

    def run_totals(self) -> dict:
        """The run's running totals a checkpoint keeps (``extra["run_totals"]``, JSON), so
        that a resumed run's metrics go on from them: groups the buffer filter rejected as
        stale (``stale_groups``) or without reward variance (``zero_variance_groups``), and
        skipped steps per reason (``skipped_steps``)."""
        return {"stale_groups": self.counts["stale_groups"],
                "zero_variance_groups": self.counts["zero_variance_groups"],
                "skipped_steps": dict(self.skips.total)}

    def restore_totals(self, totals: dict) -> None:
        """Continue from :meth:`run_totals` of a checkpoint (``{}``: a fresh run, or a
        checkpoint written before they were kept)."""
        for name in ("stale_groups", "zero_variance_groups"):
            self.counts[name] = int(totals.get(name, 0))
        self.skips.total.update({r: int(n) for r, n in totals.get("skipped_steps", {}).items()})

    def _mark_trained(self) -> None:
        """The ledger counts the current batch trained (once the step that used it is done);
        also called before a checkpoint, should a stop request fall in between."""
        if self.learner.version > self.steps_marked:
            tracked = [(k, pid) for k, pid in self.batch_keys if k is not None]
            self.ledger.trained([k for k, _ in tracked])
            self.trained_log.write(self.learner.version, tracked, self.prompts_per_epoch)
            self.steps_marked = self.learner.version
            self.batch_keys = []

    def _buffer_counts(self) -> tuple[int, int]:
        buffered = len(self.buffer.ring)   # read before accepted (see rlflow.control.run_control)
        return self.counts["accepted"], buffered

    def _publish(self) -> None:
        self.publisher.publish(self.version, self.learner.params)
        self.coordinator.set_progress(learner_version=self.version,
                                      published_version=self.version)
        if self.evals is not None:
            self.evals.request(self.version)

    # ------------------------------------------------------------------ one step
    def step(self) -> dict | None:
        """One step; returns its metrics, or None when it was skipped (see :meth:`skip`)."""
        t0 = time.monotonic()
        nxt, self.next_groups = self.next_groups, None
        if nxt is not None and nxt.error is not None:
            raise nxt.error
        groups = self.take_groups(nxt.groups if nxt is not None else ())
        t_wait = time.monotonic() - t0
        # built at the version the step before was to make; rebuilt when it made none
        built = nxt.built if nxt is not None and nxt.version == self.version else None
        batch, info = built if built is not None else self.learner.build_batch(groups)
        if not self._stepped:
            self._stepped = True
            report_phase("compiling the train step (the first step of this run)")
        reason = skip_reason(info)
        if reason is not None:
            self.skip(groups, reason, info)
            return None
        # A stop request (SIGTERM) waits until this version's metrics and samples are
        # written: the exit checkpoint of a version always has its metrics record.
        with pc.deferred_stop():
            return self._step_and_record(groups, batch, info, t0, t_wait,
                                         checked=built is not None)

    def _step_and_record(self, groups, batch, info, t0: float, t_wait: float, *,
                         checked: bool = False) -> dict:
        t1 = time.monotonic()
        if self.hosts is None:
            pending, distributed = self.learner.dispatch(batch, checked=checked), {}
        else:                   # every host steps; batch bytes distributed are logged
            pending, distributed = self.hosts.dispatch(self.learner, batch, checked=checked)
        self.prefetch()                           # overlaps the step on the device
        metrics = pull_metrics(pending)
        metrics.update(distributed)
        t_step = time.monotonic() - t1
        if self.learner.version == self.version:  # the step's own guard: no kept token
            # loss tokens there were (skip_reason passed): the rollout correction rejected all
            rejected = metrics.get("learner/tokens", 0) > 0
            self.skip(groups, "all_rejected" if rejected else "mixed", info)
            return None
        self.skips.trained()
        self.version = self.learner.version
        self._mark_trained()
        t2 = time.monotonic()
        if self.version % self.cfg.runtime.publish_every == 0 or \
                self.version == self.cfg.learner.num_steps:
            self._publish()
        else:
            self.coordinator.set_progress(learner_version=self.version)
        total = time.monotonic() - t0
        t_publish = time.monotonic() - t2
        rewards = np.concatenate([g["rewards"] for g in groups])
        ranges = [policy_version_range(g) for g in groups]
        # batch/dropped_bad_reward_groups is always 0 here (records with a non-finite reward
        # are refused on the wire, rlflow.exchange.records); the sampler counts the real ones
        # (sampler/dropped_bad_reward_groups), so it is not logged.
        metrics.update({k: v for k, v in info.items() if k not in UNLOGGED_BATCH_INFO})
        metrics.update({
            "reward/accuracy": float(np.mean(rewards >= self.threshold)),
            "learner/step_time_s": t_step,
            "learner/compile_s": self.learner.last_compile_s,
            "learner/idle_frac": t_wait / max(total, 1e-9),
            "learner/wall_s": total,
            # the step's wall time split (rlflow.run.perf): waiting for rollouts, building
            # the batch, the train step's compute, publishing the new weights
            "perf/time_wait_s": t_wait,
            "perf/time_batch_s": max(t1 - t0 - t_wait, 0.0),
            "perf/time_compute_s": t_step,
            "perf/time_publish_s": t_publish,
            **self.learner.perf_metrics(info, t_step - self.learner.last_compile_s),
            "learner/version": self.version,
            "rollout/version_min": min(r[0] for r in ranges),
            "rollout/version_max": max(r[1] for r in ranges),
            "learner/stale_groups_dropped": self.counts["stale_groups"],
            "learner/zero_variance_groups_dropped": self.counts["zero_variance_groups"],
            "learner/published_version": self.coordinator.published_version,
            "sync/bytes_per_version": float(self.publisher.bytes),
            **self.skips.metrics(),
        })
        metrics.update(self._buffer_metrics())
        metrics.update(self._sampler_metrics())
        metrics.update(self.ledger.metrics())
        metrics.update(self.prompt_counts)
        metrics.update(self.publisher.transfer_metrics())
        self.writer.log(self.version, metrics)
        if self.writer.samples_due(self.version):
            self.writer.log_samples(self.version, completion_samples(
                groups, self.tokenizer, reasoning=self.reasoning))
        if self.evals is not None:
            self.evals.log_finished()
        return metrics

    def _buffer_metrics(self) -> dict:
        m = self.buffer.metrics()
        last, self._last_buffer = self._last_buffer, m
        return {"buffer/fill": m["fill_fraction"],
                "buffer/producer_wait_s": m["producer_wait_s"] - last["producer_wait_s"],
                "buffer/consumer_wait_s": m["consumer_wait_s"] - last["consumer_wait_s"],
                "buffer/dropped_full": m["dropped_full"], "buffer/rejected": m["rejected"]}

    def _sampler_metrics(self) -> dict:
        from rlflow.control.replica_metrics import replica_metrics

        statuses = self.coordinator.live_statuses()
        out = replica_metrics(statuses, self.coordinator.restarts(),
                              self.publisher.publish_time, self.coordinator.timeouts())
        out.update(self.rates.update(statuses, time.time()))
        return out

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, metrics=None, *, final: bool = False) -> None:
        self._mark_trained()
        if self.hosts is not None:      # every host writes its shards
            self.hosts.before_save(final)
            self.checkpointer.wait()
        ck = self.learner.checkpoint(
            data_state=self.ledger.state(),
            extra={"accepted_groups": self.counts["accepted"], "run_totals": self.run_totals()},
            metadata=ckpt_lib.run_metadata(self.cfg, self.learner.mesh))
        finite = None
        if metrics is not None:
            finite = {k: v for k, v in metrics.items()
                      if isinstance(v, float) and np.isfinite(v)}
        if final:
            self.checkpointer.save_final(ck, metrics=finite)
        else:
            self.checkpointer.save(ck, metrics=finite)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        n = self.cfg.learner.num_steps
        metrics = None
        try:
            while self.version < n:
                pc.raise_if_stopped()
                step_metrics = self.step()
                if step_metrics is None:          # skipped: counted, nothing to log or save
                    continue
                metrics = step_metrics
                log.info("step %d/%d reward %.3f stale %.2f wait %.2fs step %.2fs", self.version,
                         n, metrics["reward/mean"], metrics["staleness/mean"],
                         metrics["buffer/consumer_wait_s"], metrics["learner/step_time_s"])
                if self.checkpointer.should_save(self.version):
                    # not cut in half by a stop request: the exit checkpoint below would
                    # start the same step's save again over the half-started one
                    with pc.deferred_stop():
                        self._checkpoint(metrics)
        finally:
            if self.version > self.start_step or metrics is not None:
                self._checkpoint(metrics, final=True)
        self._finish()

    def _finish(self) -> None:
        """Wait for the evaluations still running; tell the samplers the run is done; keep
        the buffer drained until they saw it."""
        if self.evals is not None:
            self.evals.wait(drain=lambda: self.buffer.get_groups(1, timeout=0.05))
        self.coordinator.set_progress(done=True)
        if self.hosts is not None:
            self.hosts.done()
        deadline = time.monotonic() + DONE_GRACE_S
        while time.monotonic() < deadline and not self.coordinator.acknowledged_done():
            try:
                self.buffer.get_groups(1, timeout=0.05)
            except Exception:  # noqa: BLE001 - timeouts while draining are expected
                pass
        log.info("learner finished at version %d", self.version)

    def close(self) -> None:
        closers = [self.coordinator.close, self.buffer.close, self.publisher.close,
                   self.writer.close, self.checkpointer.close, self.trained_log.close]
        if self.hosts is not None:
            closers.append(self.hosts.close)
        for closer in closers:
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - keep closing the rest
                log.warning("closing: %s", e)


def main(cfg, endpoints: pc.Endpoints) -> None:
    """Run the learner program until ``learner.num_steps`` steps are done.

    Raises:
      rlflow.exchange.ring.ProducerError: a sampler reported a failure.
      rlflow.exchange.ring.BufferTimeoutError: no groups for ``buffer.timeout_s`` seconds.
      rlflow.control.ledger.PromptsExhaustedError: the prompts ran out before num_steps.
      rlflow.control.replicas.NoReplicaError: no sampler replica alive for
        ``runtime.replica_timeout_s`` seconds.
      rlflow.control.programs_common.Stopped: SIGTERM (the exit checkpoint is saved first).
      rlflow.learner.skips.DegenerateStepsError: ``learner.max_consecutive_skipped_steps``
        steps in a row had no sample to train on (the message names the reason and fields).
    """
    program = LearnerProgram(cfg, endpoints)
    try:
        program.run()
    except pc.Stopped:
        if program.hosts is not None:   # after the exit checkpoint: the other hosts exit too
            program.hosts.done()
        raise
    finally:
        program.close()
