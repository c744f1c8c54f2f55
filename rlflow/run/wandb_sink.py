"""Weights & Biases as a second sink of the run folder's :class:`rlflow.run.metrics.MetricsWriter`.

With ``metrics.wandb.mode`` "online" or "offline" (:class:`rlflow.config.WandbConfig`) the
writer also sends the resolved config (secrets redacted, :func:`rlflow.config.secrets.
redact_config`: the same dict as ``config.json``), every :meth:`MetricsWriter.log` record
(``run.log(values, step=step)``), the sample completions and each held-out evaluation's
logged samples (``eval/samples``: prompt, completion, answer, reward, correct, version) as
``wandb.Table`` s and, when the writer closes, the report's plots
(:func:`rlflow.run.report.make_report`) as images. An evaluation finishes after later
training steps were logged: its metrics and table go to the latest step logged and the
``eval/*`` charts use ``eval/version`` as their x axis (W&B's ``define_metric``).

Files: ``<run folder>/wandb/`` (W&B's own layout; ``offline-run-*`` folders in offline
mode, uploaded later with ``wandb sync``) and ``<run folder>/wandb_run_id``, the W&B run
id: a resumed run (same run folder) continues the same W&B run (``resume="allow"``).
W&B keeps a run's steps increasing: the steps a resumed run logs again after the
checkpoint it resumed from (already in W&B from the interrupted invocation) are dropped
by W&B with a warning, while ``metrics.jsonl`` holds each step once.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from typing import Any, Mapping, Sequence

logger = logging.getLogger("rlflow.run.wandb")

RUN_ID_FILE = "wandb_run_id"
WANDB_DIR = "wandb"
SAMPLE_COLUMNS = ("step", "version", "reward", "prompt", "completion")
EVAL_SAMPLE_COLUMNS = ("version", "prompt", "completion", "answer", "reward", "correct")
EVAL_TABLE = "eval/samples"


class WandbSink:
    """One W&B run mirroring a run folder.

    Args:
      run_dir: the run folder.
      wandb_cfg: :class:`rlflow.config.WandbConfig` (``mode`` not "off").
      config: the redacted config dict (as written to ``config.json``).
      default_name: run name when ``wandb_cfg.run_name`` is empty (the experiment's name).

    Raises:
      ImportError: ``wandb`` is not installed (the message says how to install it).
    """

    def __init__(self, run_dir: str, wandb_cfg, config: Mapping[str, Any], *,
                 default_name: str = "", report_plots=None):
        try:
            import wandb
        except ImportError:
            raise ImportError("metrics.wandb.mode is not 'off' but the wandb package is not "
                              "installed: pip install wandb (or set metrics.wandb.mode='off')"
                              ) from None
        self._wandb = wandb
        # make_report(run_dir, out_dir=..., fmt="md") or None: handed in by the writer's
        # owner, so this module (imported by the metrics writer) never imports the report
        self.report_plots = report_plots
        self.run_dir = os.fspath(run_dir)
        wandb_dir = os.path.join(self.run_dir, WANDB_DIR)
        os.makedirs(wandb_dir, exist_ok=True)
        id_path = os.path.join(self.run_dir, RUN_ID_FILE)
        run_id = None
        if os.path.isfile(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip() or None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]        # W&B ids: [a-z0-9]
            with open(id_path + ".tmp", "w", encoding="utf-8") as f:
                f.write(run_id + "\n")
            os.replace(id_path + ".tmp", id_path)
        # code, git state and the program's arguments stay out of the W&B run (what the run
        # folder keeps is the redacted config)
        settings = wandb.Settings(save_code=False, disable_git=True, disable_code=True,
                                  x_disable_stats=True, console="off", silent=True)
        self.run = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity or None,
                              name=wandb_cfg.run_name or default_name or None,
                              tags=list(wandb_cfg.tags) or None, mode=wandb_cfg.mode,
                              dir=self.run_dir, id=run_id, resume="allow",
                              config=dict(config), settings=settings, reinit="create_new")
        self.run_id = run_id
        # held-out evaluations arrive after later training steps (async mode): their metrics
        # and tables are logged at the latest step (log) and charted against eval/version
        self.run.define_metric("eval/version")
        self.run.define_metric("eval/*", step_metric="eval/version")
        self._last_step = -1
        logger.info("W&B run %s (%s mode) in %s", run_id, wandb_cfg.mode, wandb_dir)

    def _step(self, step: int) -> int:
        """The W&B step to log ``step``'s values at: ``step``, or the latest step logged by
        this sink when ``step`` is older (W&B drops values logged at a step below its
        current one: a held-out evaluation of version v finishes after steps > v were
        logged; its values carry ``eval/version``, the x axis of the ``eval/*`` charts)."""
        self._last_step = max(self._last_step, int(step))
        return self._last_step

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """One step's finite scalar metrics (at :meth:`_step`)."""
        self.run.log(dict(values), step=self._step(step))

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Sample completions (the records written to ``samples.jsonl``) as a table."""
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS),
                                  data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in records])
        self.run.log({"samples": table}, step=self._step(step))

    def log_eval_samples(self, version: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """One held-out evaluation's samples (rows of ``eval_samples.jsonl``) as the table
        ``eval/samples`` (columns :data:`EVAL_SAMPLE_COLUMNS`), with ``eval/version``
        ``version``, the policy version that generated them."""
        table = self._wandb.Table(columns=list(EVAL_SAMPLE_COLUMNS), data=[
            [int(version) if c == "version" else r.get(c) for c in EVAL_SAMPLE_COLUMNS]
            for r in rows])
        self.run.log({EVAL_TABLE: table, "eval/version": float(version)},
                     step=self._step(version))

    def log_report_plots(self) -> int:
        """Render the run folder's report plots (into a temporary folder) and log each as
        ``report/<name>`` image; returns the number logged (0, with a warning, when the
        report cannot be made: a report problem never fails a run; 0 without
        ``report_plots``)."""
        if self.report_plots is None:
            return 0
        with tempfile.TemporaryDirectory(prefix="rlflow-wandb-report-") as out:
            try:
                self.report_plots(self.run_dir, out_dir=out, fmt="md")
            except Exception as e:  # noqa: BLE001 - see the docstring
                logger.warning("W&B: no report plots (%s)", e)
                return 0
            plots = os.path.join(out, "plots")
            names = sorted(n for n in os.listdir(plots) if n.endswith(".png"))
            if names:
                self.run.log({f"report/{n[:-4]}": self._wandb.Image(os.path.join(plots, n))
                              for n in names})
        return len(names)

    def finish(self) -> None:
        """Log the report's plots and close the W&B run (idempotent)."""
        if self.run is None:
            return
        try:
            self.log_report_plots()
        finally:
            self.run.finish()
            self.run = None
            # stops W&B's service process once it has written everything: the run's files
            # are complete when this returns (finish alone can return before the last
            # records reach run-<id>.wandb)
            self._wandb.teardown()
