"""``rlflow report <run folder>``: PNG plots and one HTML and/or Markdown page of a run.

Reads what :class:`rlflow.run.metrics.MetricsWriter` wrote (``metrics.jsonl``,
``samples.jsonl``, ``config.json``) and writes into ``<run folder>/report/`` (or ``--out-dir``)::

    plots/reward.png      reward mean (+/- std band), min, max; verifier accuracy
    plots/length.png      response length mean/max; truncation rate
    plots/kl_entropy.png  KL to the reference; policy entropy
    plots/throughput.png  sampler tokens/s; idle fractions, slot occupancy, buffer fill
    plots/staleness.png   staleness histogram over steps (stacked); mean/max staleness
    plots/timing.png      learner step time, weight sync, sampler pause; buffer waits
    plots/weight_pause.png  the sampler's pause per weight version (decode time lost to the
                          swap) beside the transfer and cast times; the pause's parts (pull,
                          cast, install) stacked (runs whose sampler swapped weights in)
    plots/mismatch.png    sampler / learner mismatch: KL(behaviour || learner) k3 by policy
                          lag; chi-square, log-perplexity difference, KL k1 (runs whose
                          step logged ``mismatch/*``, rlflow.learner.rollout_correction)
    plots/rollout_correction.png  tokens and samples the rollout correction rejected
                          (by policy lag) or truncated
    plots/eval.png        held-out evaluation by policy version: pass@1, pass@k, maj@k,
                          mean reward, truncation rate; completion length (runs with
                          ``eval.every_steps``; samples in ``eval_samples.jsonl``)
    report.html           self-contained page (PNG data URIs), metric table, samples table
    report.md             the same page in Markdown (relative image links)

A plot whose metrics were never logged is left out and the page says so. Plots use
matplotlib's Agg canvas (no display needed).
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Sequence

import numpy as np
import tyro

from rlflow.run.metrics import (CONFIG_FILE, LAG_BUCKETS, METRICS_FILE, SAMPLES_FILE,
                                STALENESS_HIST, completion_text)
from rlflow.run import files
from rlflow.run.folder import RunFolderError, metrics_by_step, read_jsonl

FIGSIZE = (8.0, 5.5)  # inches
DPI = 100


@dataclass(frozen=True)
class Panel:
    """One axes: a y label and the metrics drawn on it.

    ``band`` = (mean, std) shades mean +/- std; ``stacked`` draws the series as a stacked area.
    """

    ylabel: str
    series: tuple[str, ...]
    band: Optional[tuple[str, str]] = None
    stacked: bool = False


@dataclass(frozen=True)
class PlotSpec:
    name: str
    title: str
    panels: tuple[Panel, Panel]


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Reward", (
        Panel("reward", ("reward/mean", "reward/min", "reward/max"),
              band=("reward/mean", "reward/std")),
        Panel("accuracy", ("reward/accuracy",)))),
    PlotSpec("length", "Response length", (
        Panel("tokens", ("response/length_mean", "response/length_max")),
        Panel("truncation rate", ("response/truncation_rate",)))),
    PlotSpec("kl_entropy", "KL and entropy", (
        Panel("KL (nats)", ("policy/kl",)),
        Panel("entropy (nats)", ("policy/entropy",)))),
    PlotSpec("throughput", "Throughput and idle fractions", (
        Panel("sampler tokens/s", ("sampler/tokens_per_s",)),
        Panel("fraction", ("learner/idle_frac", "sampler/idle_frac",
                           "sampler/slot_occupancy", "buffer/fill")))),
    PlotSpec("staleness", "Staleness (policy versions)", (
        Panel("fraction of samples", STALENESS_HIST, stacked=True),
        Panel("versions", ("staleness/mean", "staleness/max")))),
    PlotSpec("perf", "Learner MFU and step time split", (
        Panel("MFU (fraction)", ("perf/mfu",)),
        Panel("seconds per step", ("perf/time_wait_s", "perf/time_batch_s",
                                   "perf/time_compute_s", "perf/time_publish_s"),
              stacked=True))),
    PlotSpec("timing", "Timing", (
        Panel("seconds", ("learner/step_time_s", "sync/weight_sync_s", "sync/sampler_pause_s")),
        Panel("wait (s)", ("buffer/producer_wait_s", "buffer/consumer_wait_s")))),
)


def replica_plots(by_step: dict[int, dict[str, float]]) -> tuple[PlotSpec, ...]:
    """The per-replica plot (tokens/s and policy version of each sampler replica) and the
    prompt ledger's counts, for runs that logged them (``replica/<i>/*``, ``ledger/*``)."""
    names = {k for m in by_step.values() for k in m}
    replicas = sorted({k.split("/")[1] for k in names if k.startswith("replica/")},
                      key=lambda i: int(i) if i.isdigit() else 0)
    if not replicas:
        return ()
    return (
        PlotSpec("replicas", "Sampler replicas", (
            Panel("tokens/s", tuple(f"replica/{i}/tokens_per_s" for i in replicas)),
            Panel("policy version", tuple(f"replica/{i}/version" for i in replicas)))),
        PlotSpec("ledger", "Prompt ledger", (
            Panel("prompts (total)", ("ledger/admitted", "ledger/trained", "ledger/redispatched",
                                      "ledger/dropped", "ledger/duplicates")),
            Panel("prompts (now)", ("ledger/in_flight", "ledger/buffered", "ledger/returned")))),
    )


#: The sampler's pause per weight version beside its transfer time (rlflow.sampler.weight_pause).
WEIGHT_PAUSE_PLOT = PlotSpec("weight_pause", "Sampler pause per weight version vs transfer time", (
    Panel("seconds", ("sampler/weight_transfer_s", "sampler/weight_cast_s",
                      "sampler/weight_pause_s")),
    Panel("pause parts (s)", ("sampler/weight_pause_pull_s", "sampler/weight_pause_cast_s",
                              "sampler/weight_pause_install_s"), stacked=True)))


def weight_pause_plots(by_step: dict[int, dict[str, float]]) -> tuple[PlotSpec, ...]:
    """The weight-pause plot, for runs whose sampler swapped weights in (``sampler/weight_*``
    logged after its first swap)."""
    return (WEIGHT_PAUSE_PLOT,) if _has(by_step, "sampler/weight_pause_s") else ()


def mismatch_plots(by_step: dict[int, dict[str, float]]) -> tuple[PlotSpec, ...]:
    """The mismatch and rollout-correction plots, for runs whose train step logged them
    (``mismatch/*``, ``rollout_correction/*``; :data:`rlflow.run.metrics.LAG_BUCKETS`)."""
    if not _has(by_step, "mismatch/kl_k3"):
        return ()
    lags = lambda name: (name,) + tuple(f"{name}_{b}" for b in LAG_BUCKETS)  # noqa: E731
    return (
        PlotSpec("mismatch", "Sampler / learner mismatch (by policy lag)", (
            Panel("KL(behaviour || learner), k3 (nats)", lags("mismatch/kl_k3")),
            Panel("chi-square; nats", ("mismatch/chi2", "mismatch/log_ppl_diff",
                                       "mismatch/kl_k1")))),
        PlotSpec("rollout_correction", "Rollout correction", (
            Panel("fraction rejected", ("rollout_correction/masked_token_frac",)
                  + lags("rollout_correction/masked_seq_frac")),
            Panel("fraction truncated", ("rollout_correction/truncated_token_frac",
                                         "rollout_correction/truncated_seq_frac")))),
    )


def eval_plots(by_step: dict[int, dict[str, float]]) -> tuple[PlotSpec, ...]:
    """The held-out evaluation plot, for runs that logged one (``eval/*``, at the versions
    evaluated: points joined across the steps between)."""
    names = {k for m in by_step.values() for k in m}
    if "eval/pass@1" not in names:
        return ()
    at_k = tuple(sorted(n for n in names if n.startswith(("eval/pass@", "eval/maj@"))
                        and n != "eval/pass@1"))
    return (PlotSpec("eval", "Held-out evaluation (by policy version)", (
        Panel("fraction / reward", ("eval/pass@1",) + at_k + ("eval/reward_mean",
                                                             "eval/truncation_rate")),
        Panel("completion tokens", ("eval/completion_length",)))),)


@dataclass(frozen=True)
class ReportArgs:
    """Render plots and a page for a run folder.

    Attributes:
      run_dir: the run folder (``runs/<name>``) written by ``rlflow train``.
      out_dir: where to write (default: ``<run_dir>/report``).
      format: "html", "md" or "both".
      max_samples: most recent sample completions shown in the table.
    """

    run_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    out_dir: str = ""
    format: Literal["html", "md", "both"] = "both"
    max_samples: int = 20


def _series(by_step: dict[int, dict[str, float]], name: str) -> np.ndarray:
    return np.array([row.get(name, math.nan) for row in by_step.values()], dtype=np.float64)


def _has(by_step, name: str) -> bool:
    return bool(np.isfinite(_series(by_step, name)).any())


def plot(spec: PlotSpec, by_step: dict[int, dict[str, float]], path: str) -> bool:
    """Draw ``spec`` to a PNG of FIGSIZE * DPI pixels; False (nothing written) when none of
    its metrics has a finite value."""
    if not any(_has(by_step, n) for p in spec.panels for n in p.series):
        return False
    from matplotlib.figure import Figure  # Agg canvas; never touches pyplot's backend
    from matplotlib.ticker import MaxNLocator

    steps = np.array(list(by_step), dtype=np.float64)
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, panel in zip(axes, spec.panels):
        present = [n for n in panel.series if _has(by_step, n)]
        if panel.stacked and present:
            ys = np.stack([_series(by_step, n) for n in present])
            rows = np.isfinite(ys).any(axis=0)  # steps that logged the histogram
            ax.stackplot(steps[rows], np.nan_to_num(ys[:, rows]), labels=present, alpha=0.8)
        else:
            for n in present:            # steps that logged it (e.g. evaluations: every N)
                y = _series(by_step, n)
                ok = np.isfinite(y)
                ax.plot(steps[ok], y[ok], marker="o" if ok.sum() <= 50 else None,
                        markersize=3, label=n)
        if panel.band and all(_has(by_step, n) for n in panel.band):
            mean, std = (_series(by_step, n) for n in panel.band)
            ax.fill_between(steps, mean - std, mean + std, alpha=0.2, label="mean ± std")
        if not present:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center")
        else:
            ax.legend(fontsize="small", loc="best")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(spec.title)
    fig.savefig(path, dpi=DPI)
    return True


def _cell(text, limit: int = 600) -> str:
    s = str(text)
    if len(s) > limit:
        s = s[:limit] + " …"
    return s


def _fmt(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.4g}"


def _outcome(run_dir: str, last_step: int, planned) -> str:
    """How the run's last ``rlflow train`` ended, from its ``summary.json`` (written when the
    launcher ends): finished, stopped early, or, without that file, still running or ended
    without its launcher (``kill -9``, a lost machine)."""
    try:
        summary = json.loads(files.read_text(files.join(run_dir, "summary.json")))
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict):
        done = isinstance(planned, int) and last_step >= planned
        return ("all planned steps logged; no summary.json" if done else
                "not finished: no summary.json (still running, or ended without its launcher: "
                "killed, or the machine was lost)")
    reached = summary.get("steps_completed", last_step)
    if summary.get("success"):
        return f"finished (step {reached})"
    return f"stopped early at step {reached} (see logs/ for why)"


def _summary_rows(by_step) -> list[tuple[str, str, str, str, str]]:
    names = sorted({k for row in by_step.values() for k in row})
    rows = []
    for n in names:
        y = _series(by_step, n)
        fin = y[np.isfinite(y)]
        last = fin[-1] if fin.size else math.nan
        rows.append((n, _fmt(last), *(_fmt(f(fin)) if fin.size else "–"
                                      for f in (np.min, np.max, np.mean))))
    return rows


def _md_cell(text) -> str:
    return html.escape(_cell(text)).replace("|", "\\|").replace("\n", "<br>")


def _markdown(title, meta, plots, missing, summary, samples, problems) -> str:
    out = [f"# {title}", ""] + [f"- {k}: {v}" for k, v in meta] + [""]
    if problems:
        out += ["## Problems reading the run folder", ""] + [f"- {p}" for p in problems] + [""]
    out += ["## Plots", ""]
    out += [f"![{spec.title}](plots/{spec.name}.png)\n" for spec in plots]
    out += [f"- {spec.title}: not logged ({', '.join(_plot_metrics(spec))})" for spec in missing]
    out += ["", "## Metrics", "", "| metric | last | min | max | mean |", "|---|---|---|---|---|"]
    out += ["| " + " | ".join(r) + " |" for r in summary]
    out += ["", f"## Sample completions (latest {len(samples)})", ""]
    if samples:
        out += ["| step | version | reward | prompt | completion |", "|---|---|---|---|---|"]
        out += ["| " + " | ".join([_md_cell(s.get(k)) for k in ("step", "version", "reward",
                                                                "prompt")]
                                  + [_md_cell(completion_text(s))]) + " |" for s in samples]
    else:
        out.append("No sample completions were written (metrics.samples_every = 0?).")
    return "\n".join(out) + "\n"


def _html(title, meta, plots, missing, summary, samples, problems, img_dir, config) -> str:
    e = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'>", f"<title>{e(title)}</title>",
           "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
           "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 6px;"
           "vertical-align:top}td.t{white-space:pre-wrap;max-width:420px}</style></head><body>",
           f"<h1>{e(title)}</h1><ul>"]
    out += [f"<li>{e(k)}: {e(str(v))}</li>" for k, v in meta] + ["</ul>"]
    if problems:
        out += ["<h2>Problems reading the run folder</h2><ul>"]
        out += [f"<li>{e(p)}</li>" for p in problems] + ["</ul>"]
    out.append("<h2>Plots</h2>")
    for spec in plots:
        with open(os.path.join(img_dir, f"{spec.name}.png"), "rb") as f:
            data = base64.b64encode(f.read()).decode()
        out.append(f"<img alt='{e(spec.title)}' src='data:image/png;base64,{data}'><br>")
    if missing:
        out += ["<ul>"] + [f"<li>{e(s.title)}: not logged ({e(', '.join(_plot_metrics(s)))})"
                           "</li>" for s in missing] + ["</ul>"]
    out += ["<h2>Metrics</h2><table><tr><th>metric</th><th>last</th><th>min</th><th>max</th>"
            "<th>mean</th></tr>"]
    out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in summary]
    out += ["</table>", f"<h2>Sample completions (latest {len(samples)})</h2>"]
    if samples:
        out.append("<table><tr><th>step</th><th>version</th><th>reward</th><th>prompt</th>"
                   "<th>completion</th></tr>")
        for s in samples:
            out.append("<tr>" + "".join(f"<td>{e(_cell(s.get(k)))}</td>" for k in
                                        ("step", "version", "reward"))
                       + f"<td class='t'>{e(_cell(s.get('prompt')))}</td>"
                       + f"<td class='t'>{e(_cell(completion_text(s)))}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>No sample completions were written (metrics.samples_every = 0?).</p>")
    if config is not None:
        out.append("<h2>Config</h2><details><summary>config.json</summary><pre>"
                   f"{e(json.dumps(config, indent=2))}</pre></details>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _plot_metrics(spec: PlotSpec) -> list[str]:
    return [n for p in spec.panels for n in p.series]


def make_report(run_dir: str, *, out_dir: str = "", fmt: str = "both",
                max_samples: int = 20, problems_out: Optional[list] = None) -> str:
    """Write the plots and the page(s) of ``run_dir``; return the page's path (the HTML
    page when ``fmt == "both"``). ``problems_out``, when given, receives the problems the
    page lists under "Problems reading the run folder" (one string each: file, line or
    step, what is wrong).

    Raises:
      RunFolderError: ``run_dir`` is not a folder, or has no ``metrics.jsonl`` (a run folder
        whose run has not finished a step says so) or no valid metric record in it (bad
        lines are listed on the page instead of failing).
      ValueError: ``fmt`` not "html" / "md" / "both", or ``max_samples < 0``.
    """
    if fmt not in ("html", "md", "both"):
        raise ValueError(f"format must be 'html', 'md' or 'both', got {fmt!r}")
    if max_samples < 0:
        raise ValueError(f"max_samples must be >= 0, got {max_samples}")
    if not files.isdir(run_dir):
        raise RunFolderError(f"{run_dir}: not a folder (expected a run folder runs/<name>)")
    metrics_path = files.join(run_dir, METRICS_FILE)
    if not files.isfile(metrics_path) and files.isfile(files.join(run_dir, CONFIG_FILE)):
        logs = os.path.join(files.local_side(run_dir), "logs")
        raise RunFolderError(f"{metrics_path}: file not found: the run in {run_dir} has not "
                             f"finished a step (still starting, or it stopped before its "
                             f"first step" + (f"; its programs' logs are in {logs})"
                                              if os.path.isdir(logs) else ")"))
    records, problems = read_jsonl(metrics_path)
    by_step = metrics_by_step(records)
    problems += [f"{METRICS_FILE}: step {r['step']}: non-finite values {r['non_finite']} "
                 "(recorded as null)" for r in records if r.get("non_finite")]
    if not by_step:
        raise RunFolderError(f"{metrics_path}: no valid metric records"
                             + (f" ({problems[0]} ...)" if problems else ""))
    samples = []
    if files.isfile(files.join(run_dir, SAMPLES_FILE)):
        samples, bad = read_jsonl(files.join(run_dir, SAMPLES_FILE))
        problems += bad
    samples = samples[-max_samples:] if max_samples else []
    config = None
    config_path = files.join(run_dir, CONFIG_FILE)
    if files.isfile(config_path):
        try:
            config = json.loads(files.read_text(config_path))
        except json.JSONDecodeError as err:
            problems.append(f"{config_path}: not valid JSON ({err})")
    else:
        problems.append(f"{config_path}: file not found")

    out_dir = out_dir or files.join(run_dir, "report")
    # Plots and pages are drawn into a local folder; an object-store out_dir gets copies.
    target, out_dir = out_dir, (out_dir if not files.is_url(out_dir)
                                else tempfile.mkdtemp(prefix="rlflow-report-"))
    img_dir = os.path.join(out_dir, "plots")
    os.makedirs(img_dir, exist_ok=True)
    drawn, missing = [], []
    for spec in (PLOTS + weight_pause_plots(by_step) + mismatch_plots(by_step)
                 + replica_plots(by_step) + eval_plots(by_step)):
        (drawn if plot(spec, by_step, os.path.join(img_dir, f"{spec.name}.png"))
         else missing).append(spec)
    name = (config or {}).get("name") or os.path.basename(files.absolute(run_dir).rstrip("/"))
    steps = list(by_step)
    planned = ((config or {}).get("learner") or {}).get("num_steps")
    of = f" of {planned} planned" if isinstance(planned, int) else ""
    meta = [("run folder", files.absolute(run_dir)), ("steps", f"{steps[0]} … {steps[-1]} "
            f"({len(steps)} logged{of})"), ("outcome", _outcome(run_dir, steps[-1], planned)),
            ("generated", time.strftime("%Y-%m-%d %H:%M:%S"))]
    title = f"rlflow run report: {name}"
    summary = _summary_rows(by_step)
    if problems_out is not None:
        problems_out.extend(problems)
    page = ""
    if fmt in ("md", "both"):
        page = os.path.join(out_dir, "report.md")
        with open(page, "w", encoding="utf-8") as f:
            f.write(_markdown(title, meta, drawn, missing, summary, samples, problems))
    if fmt in ("html", "both"):
        page = os.path.join(out_dir, "report.html")
        with open(page, "w", encoding="utf-8") as f:
            f.write(_html(title, meta, drawn, missing, summary, samples, problems, img_dir,
                          config))
    if target != out_dir:             # object store: put every file, then drop the local one
        for folder, _, names in os.walk(out_dir):
            for n in names:
                local = os.path.join(folder, n)
                with open(local, "rb") as f:
                    files.write_atomic(files.join(target, os.path.relpath(local, out_dir)),
                                       f.read())
        shutil.rmtree(out_dir, ignore_errors=True)
        page = files.join(target, os.path.basename(page))
    return page


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``rlflow report`` entry point: prints the page path; 2 on a bad run folder or one
    it cannot write the report in (``--out-dir`` to write it elsewhere)."""
    args = tyro.cli(ReportArgs, args=list(sys.argv[1:] if argv is None else argv),
                    prog="rlflow report")
    problems: list = []
    try:
        page = make_report(args.run_dir, out_dir=args.out_dir, fmt=args.format,
                           max_samples=args.max_samples, problems_out=problems)
    except (RunFolderError, ValueError) as err:
        print(f"rlflow report: {err}", file=sys.stderr)
        return 2
    except OSError as err:            # a read-only run folder, no space: name where it wrote
        where = args.out_dir or os.path.join(args.run_dir, "report")
        if files.no_space(err) is not None:
            line = files.full_line(where, files.no_space(err), "the report",
                                   then="free space, or write it elsewhere with --out-dir")
            print(f"rlflow report: {line}", file=sys.stderr)
            return 2
        print(f"rlflow report: cannot write the report in {where}: {err.strerror or err}"
              f"{': ' + str(err.filename) if err.filename else ''} (--out-dir writes it "
              f"elsewhere)", file=sys.stderr)
        return 2
    for problem in problems:        # on the page too; here so that they are not missed
        print(f"rlflow report: {problem}", file=sys.stderr)
    print(page)
    return 0

