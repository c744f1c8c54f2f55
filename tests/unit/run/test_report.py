"""`rlflow report`: PNG plots and an HTML/Markdown page of a run folder."""

from __future__ import annotations

import base64
import io
import os
import re
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest
from PIL import Image

from rlflow.console.cli import main as cli_main
from rlflow.run.metrics import MetricsWriter
from rlflow.run.report import make_report

from _synthetic_run import NUM_SAMPLES, write_run

PLOTS = ("reward", "length", "kl_entropy", "throughput", "staleness", "perf", "timing")
TAB_BLUE = np.array([31, 119, 180])  # matplotlib's first line colour ("C0")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run_dir = write_run(str(tmp_path_factory.mktemp("runs"))).run_path
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli_main(["report", run_dir])
    return run_dir, rc, out.getvalue().strip(), err.getvalue()


def _rgb(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.float64)


def test_cli_writes_page_and_prints_its_path(report):
    run_dir, rc, printed, err = report
    assert rc == 0, err
    assert printed == os.path.join(run_dir, "report", "report.html")
    assert os.path.isfile(printed)
    assert os.path.isfile(os.path.join(run_dir, "report", "report.md"))


@pytest.mark.parametrize("name", PLOTS)
def test_png_has_size_and_is_not_blank(report, name):
    run_dir = report[0]
    rgb = _rgb(os.path.join(run_dir, "report", "plots", f"{name}.png"))
    height, width, _ = rgb.shape
    assert width >= 640 and height >= 400
    assert rgb.std() > 10.0  # a blank (single-colour) image has 0
    # The first series is drawn: many pixels of matplotlib's first line colour.
    blue = (np.abs(rgb - TAB_BLUE).max(axis=-1) < 40).sum()
    assert blue > 300, f"{name}: only {blue} pixels of the first series' colour"


def test_html_embeds_every_plot_and_escapes_samples(report):
    run_dir = report[0]
    with open(os.path.join(run_dir, "report", "report.html"), encoding="utf-8") as f:
        page = f.read()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == len(PLOTS)
    files = {open(os.path.join(run_dir, "report", "plots", f"{n}.png"), "rb").read()
             for n in PLOTS}
    assert {base64.b64decode(d) for d in images} == files
    # latest samples (step 6, i = 0..2), HTML-escaped, never raw markup from the completion
    for i in range(NUM_SAMPLES):
        assert f"Q6.{i}: what is 6 + {i}? &lt;b&gt;|pipe|&lt;/b&gt;" in page
    assert "<b>|pipe|" not in page and "Done &amp; dusted" in page
    assert "<td>policy/kl</td>" in page  # metric table
    assert "&quot;lr&quot;: 3e-06" in page  # config section


def test_markdown_links_plots_and_escapes_table_cells(report):
    run_dir = report[0]
    out_dir = os.path.join(run_dir, "report")
    with open(os.path.join(out_dir, "report.md"), encoding="utf-8") as f:
        page = f.read()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert sorted(links) == sorted(f"plots/{n}.png" for n in PLOTS)
    assert all(os.path.isfile(os.path.join(out_dir, link)) for link in links)
    rows = [line for line in page.splitlines() if line.startswith("| 6 | 5 |")]
    assert len(rows) == NUM_SAMPLES
    for row in rows:  # 5 cells: pipes and newlines inside cells are escaped
        assert len(re.split(r"(?<!\\)\|", row.strip("|"))) == 5
        assert "The answer is" in row and "<br>Done &amp; dusted" in row
    assert "not logged" not in page


def test_partial_metrics_draw_what_exists_and_name_the_rest(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        for step in range(3):
            w.log(step, {"reward/mean": 0.1 * step, "policy/kl": 0.01})
        w.log(3, {"policy/kl": float("nan")})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/mean": 0.')  # a crash mid-line
    page = make_report(str(tmp_path), fmt="md")
    assert page == str(tmp_path / "report" / "report.md")
    assert not os.path.exists(tmp_path / "report" / "report.html")
    assert sorted(os.listdir(tmp_path / "report" / "plots")) == ["kl_entropy.png", "reward.png"]
    text = open(page, encoding="utf-8").read()
    assert "Staleness (policy versions): not logged (staleness/frac_0" in text
    assert f"{tmp_path}/metrics.jsonl:5: not valid JSON" in text
    assert "step 3: non-finite values ['policy/kl']" in text
    assert "No sample completions were written" in text  # no samples.jsonl
    assert "config.json: file not found" in text


def test_cli_prints_the_pages_problems_on_stderr(tmp_path, capsys):
    """The problems listed on the page reach the console too, one line each."""
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.log(1, {"reward/mean": 0.5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward/mean": 0.')  # a crash mid-line
    assert cli_main(["report", str(tmp_path), "--format", "md"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "report" / "report.md")
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"rlflow report: {tmp_path}/metrics.jsonl:2: not valid JSON")
    assert lines[1] == f"rlflow report: {tmp_path}/config.json: file not found"
    assert len(lines) == 2


def test_a_report_folder_it_cannot_write_is_one_line_not_a_traceback(tmp_path, capsys):
    """A file where report/ goes (a read-only run folder takes the same path; as root a
    read-only mode is not enforced): exit 2, the folder named, the way out given."""
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.log(1, {"reward/mean": 0.5})
    (tmp_path / "report").write_text("in the way")
    assert cli_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlflow report: cannot write the report in {tmp_path}/report: ")
    assert "(--out-dir writes it elsewhere)" in err and "Traceback" not in err
    assert cli_main(["report", str(tmp_path), "--out-dir", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "report.html").is_file()


def test_bad_run_folders_fail_with_a_named_error(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    assert "nope: not a folder" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl: file not found" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")      # a run that never finished a step
    (tmp_path / "logs").mkdir()
    assert cli_main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"rlflow report: {tmp_path}/metrics.jsonl: file not found: the run in {tmp_path} has "
        f"not finished a step (still starting, or it stopped before its first step; its "
        f"programs' logs are in {tmp_path}/logs)")
    (tmp_path / "metrics.jsonl").write_text("garbage\n")
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "no valid metric records (" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["report", str(tmp_path), "--format", "pdf"])


def test_the_header_says_how_far_the_run_got_and_how_it_ended(tmp_path):
    import json

    from _synthetic_run import NUM_STEPS

    run_dir = write_run(str(tmp_path)).run_path

    def header():
        page = make_report(run_dir, fmt="md")
        text = open(page, encoding="utf-8").read()
        return [ln for ln in text.splitlines() if ln.startswith(("- steps:", "- outcome:"))]

    steps, outcome = header()
    assert steps.endswith(f"({NUM_STEPS} logged of {NUM_STEPS} planned)")
    assert outcome == "- outcome: all planned steps logged; no summary.json"
    summary = os.path.join(run_dir, "summary.json")
    with open(summary, "w") as f:
        json.dump({"success": False, "steps_completed": 3}, f)
    assert header()[1] == "- outcome: stopped early at step 3 (see logs/ for why)"
    with open(summary, "w") as f:
        json.dump({"success": True, "steps_completed": NUM_STEPS}, f)
    assert header()[1] == f"- outcome: finished (step {NUM_STEPS})"
    os.remove(summary)
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["learner"]["num_steps"] = NUM_STEPS + 10                # killed before the end
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    steps, outcome = header()
    assert steps.endswith(f"({NUM_STEPS} logged of {NUM_STEPS + 10} planned)")
    assert outcome.startswith("- outcome: not finished: no summary.json")


def test_multi_turn_samples_show_their_turns(tmp_path):
    """samples.jsonl keeps an episode's turns; the report (md, html) and the TensorBoard
    table show one line per turn with its role, not the run-together completion."""
    turns = [{"role": "assistant", "text": "5<|im_end|>"},
             {"role": "environment", "text": "<|im_start|>user\nhigher<|im_end|>"},
             {"role": "assistant", "text": "7<|im_end|>"}]
    with MetricsWriter(str(tmp_path), tensorboard=False, samples_every=1) as w:
        w.log(1, {"reward/mean": 1.0})
        w.log_samples(1, [{"prompt": "p", "completion": "5userhigher7", "reward": 1.0,
                           "version": 0, "turns": turns, "completion_ids": [1, 2, 3]}])
        with pytest.raises(TypeError, match="'turns' must be a list"):
            w.log_samples(1, [{"prompt": "p", "completion": "c", "reward": 1.0, "version": 0,
                               "turns": [{"role": "assistant"}]}])
    import json
    [line] = open(tmp_path / "samples.jsonl", encoding="utf-8").read().splitlines()
    assert json.loads(line)["turns"] == turns and json.loads(line)["completion_ids"] == [1, 2, 3]
    make_report(str(tmp_path), fmt="both")
    md = open(tmp_path / "report" / "report.md", encoding="utf-8").read()
    assert ("[assistant] 5&lt;|im_end|&gt;<br>[environment] &lt;|im_start|&gt;user<br>higher"
            .replace("|", "\\|")) in md
    assert "5userhigher7" not in md
    page = open(tmp_path / "report" / "report.html", encoding="utf-8").read()
    assert "[environment] &lt;|im_start|&gt;user\nhigher" in page


def test_mismatch_plots_drawn_when_the_step_logged_them(tmp_path):
    """A run whose steps logged the mismatch diagnostics gets the mismatch and rollout
    correction plots (KL k3 by policy lag, rejected / truncated fractions); the table lists
    each metric."""
    from rlflow.run.metrics import LAG_BUCKETS
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        for step in range(4):
            row = {"reward/mean": 0.1 * step, "mismatch/chi2": 0.02 * step,
                   "mismatch/log_ppl_diff": 0.01, "mismatch/kl_k1": 0.003 * step,
                   "rollout_correction/masked_token_frac": 0.1,
                   "rollout_correction/truncated_token_frac": 0.05,
                   "rollout_correction/truncated_seq_frac": 0.2}
            for name in ("mismatch/kl_k3", "rollout_correction/masked_seq_frac"):
                row[name] = 0.01 * (step + 1)
                row |= {f"{name}_{b}": 0.01 * (step + 1) * (i + 1)
                        for i, b in enumerate(LAG_BUCKETS)}
            w.log(step, row)
    page = open(make_report(str(tmp_path), fmt="md"), encoding="utf-8").read()
    plots = tmp_path / "report" / "plots"
    for name in ("mismatch", "rollout_correction"):
        rgb = _rgb(str(plots / f"{name}.png"))
        assert rgb.std() > 10.0 and (np.abs(rgb - TAB_BLUE).max(axis=-1) < 40).sum() > 300
        assert f"![{'Rollout correction' if name != 'mismatch' else 'Sampler'}" in page
    assert "| mismatch/kl_k3_lag2plus | 0.12 |" in page


def test_weight_pause_plot_shows_pause_beside_transfer(tmp_path):
    """A run whose steps logged the sampler's pause per weight version gets the
    weight_pause plot (transfer, cast and pause; the pause's parts stacked)."""
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        for step in range(1, 6):
            parts = {"sampler/weight_pause_pull_s": 0.01 * step,
                     "sampler/weight_pause_cast_s": 0.02, "sampler/weight_pause_install_s": 0.005}
            w.log(step, {"reward/mean": 0.1, "sampler/weight_transfer_s": 0.5 + 0.1 * step,
                         "sampler/weight_cast_s": 0.2, **parts,
                         "sampler/weight_pause_s": sum(parts.values())})
    page = open(make_report(str(tmp_path), fmt="md"), encoding="utf-8").read()
    rgb = _rgb(str(tmp_path / "report" / "plots" / "weight_pause.png"))
    assert rgb.std() > 10.0 and (np.abs(rgb - TAB_BLUE).max(axis=-1) < 40).sum() > 300
    assert "![Sampler pause per weight version vs transfer time]" in page
    # a run that never swapped: no such plot, and nothing said missing
    assert "Sampler pause per weight version" not in open(
        make_report(write_run(str(tmp_path / "other")).run_path, fmt="md"),
        encoding="utf-8").read()
