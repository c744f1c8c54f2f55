"""A run folder belongs to exactly one run.

``runs/<name>/run.json`` (:data:`RUN_FILE`) holds the run's identity, written at its first
start: ``{"run_id": hex, "created": ISO UTC time, "identity": {...}}`` where ``identity``
is the part of the config that makes two runs different runs: the fields of
:data:`IDENTITY_FIELDS` (an allow-list: what is trained on what, scored how -- the model,
the data and its prompt format, the reward functions and weights). Its config.json, checkpoints, metrics, samples,
TensorBoard events, summary and report never mix two runs:

* ``checkpoint.resume="never"`` on a folder that holds an earlier run's records
  (:func:`earlier_run_records`) is refused (:class:`RunFolderConflict`, naming the folder and
  the two ways out: a new ``--name`` / ``--run_dir``, or ``--checkpoint.overwrite true``),
  or with ``checkpoint.overwrite`` the folder is moved aside to ``<run>.replaced-<UTC>``
  and the run starts in a clean one.
* ``checkpoint.resume="auto"`` continues the run in the folder; it is refused when the
  folder's config differs from the new one in an :data:`IDENTITY_FIELDS` field (another
  run's folder; or other LoRA adapters: ``learner.lora`` rank, targets,
  ``train_final_norm`` / ``train_embeddings``, LoRA switched on or off: the checkpoint holds
  another parameter tree). Other differences are allowed and listed in the warning returned:
  the operational settings (``reward.num_workers`` / ``timeout_s`` / ``memory_limit_mb``,
  ``data.on_bad_record``, ``data.max_prompt_tokens``, ``data.num_epochs``, logging,
  checkpoint cadence, meshes, ports) and the training settings a user tunes or extends
  mid-run (``learner.num_steps``, a learning rate).

No JAX here (the launcher calls it before starting anything).
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from rlflow.run import files

RUN_FILE = "run.json"
IDENTITY_SECTIONS: tuple[str, ...] = ("model", "data", "reward", "LoRA adapters")
# The fields that define a run (section -> field names, dotted for a nested one; "*" = every
# field of the section). A resume that changes one is another run's start (for the LoRA
# fields: a checkpoint of another parameter tree, which cannot be restored); every other
# field may change on resume.
IDENTITY_FIELDS: dict[str, tuple[str, ...]] = {
    "model": ("*",),                      # path, or the random model's architecture and seed
    "data": ("source", "path", "task", "prompt_field", "answer_field", "chat_template",
             "plain_template", "shuffle_seed"),
    "reward": ("functions", "weights"),
    "learner": ("lora.rank", "lora.targets", "lora.train_final_norm", "lora.train_embeddings"),
}
# Files / folders of a run folder that hold a run's results, listed when the folder holds a
# trained step (:func:`has_trained`; a start that failed before its first step holds none).
RESULT_ENTRIES: tuple[str, ...] = ("checkpoints", "metrics.jsonl", "samples.jsonl",
                                   "summary.json", "report", "weights")
TB_GLOB = "events.out.tfevents.*"


class RunFolderConflict(RuntimeError):
    """The run folder holds another run (message names the folder and the ways out)."""


@dataclass(frozen=True)
class PreparedRun:
    """Outcome of :func:`prepare_run_folder`.

    Attributes:
      run_id: the run's id (new, or read from ``run.json``).
      moved_to: where an earlier run's folder was moved (``checkpoint.overwrite``), or None.
      warnings: config differences of a resumed run that do not make it another run.
    """

    run_id: str
    moved_to: Optional[str] = None
    warnings: tuple[str, ...] = ()


def has_trained(run_path: str) -> bool:
    """Whether ``run_path`` holds a trained step: a complete checkpoint, or a
    ``metrics.jsonl`` record with an int ``step``."""
    from rlflow.run.summary import latest_checkpoint_step

    if latest_checkpoint_step(run_path) is not None:
        return True
    try:
        for line in files.read_bytes(files.join(run_path, "metrics.jsonl")).splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                return True
    except OSError:
        pass
    return False


def earlier_run_records(run_path: str) -> list[str]:
    """Entries of ``run_path`` that hold a run's results (non-empty ones only), sorted.

    Empty when the folder holds no trained step (:func:`has_trained`): what a start that
    failed before its first step leaves (run.json, config.json, logs/, an empty
    checkpoints/, TensorBoard event files with no step, a summary of 0 steps) holds nothing
    two runs could mix, so a rerun proceeds there whatever its settings (a new ``run.json``
    is written) and ``resume="never"`` needs no ``overwrite``.
    """
    if not has_trained(run_path):
        return []
    found = []
    for name in RESULT_ENTRIES:
        path = files.join(run_path, name)
        if files.isdir(path) and files.listdir(path):
            found.append(name + "/")
        elif files.isfile(path) and files.read_bytes(path):
            found.append(name)
    found += sorted(n for n in files.listdir(run_path) if fnmatch.fnmatch(n, TB_GLOB))
    return found


def identity_of(config: Mapping[str, Any]) -> dict:
    """The :data:`IDENTITY_FIELDS` of a config dict (``dataclasses.asdict`` form), as
    ``{section: {field: value}}``."""
    out = {}
    for section, fields in IDENTITY_FIELDS.items():
        values = config.get(section)
        if not isinstance(values, Mapping):
            out[section] = values
        elif fields == ("*",):
            out[section] = dict(values)
        else:
            out[section] = {f: _lookup(values, f) for f in fields}
    return out


def _lookup(values: Mapping[str, Any], dotted: str) -> Any:
    """``values["lora"]["rank"]`` for ``"lora.rank"``; None where a level is missing (a
    config.json written before the field existed)."""
    for key in dotted.split("."):
        if not isinstance(values, Mapping):
            return None
        values = values.get(key)
    return values


def _is_identity_field(dotted: str) -> bool:
    section, _, field = dotted.partition(".")
    fields = IDENTITY_FIELDS.get(section, ())
    return fields == ("*",) or any(field == f or field.startswith(f + ".") for f in fields)


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any],
                       prefix: str = "") -> list[str]:
    """Dotted names of the fields whose values differ between two config dicts, sorted."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, name + ".")
        elif (list(a) if isinstance(a, tuple) else a) != (list(b) if isinstance(b, tuple) else b):
            out.append(name)
    return out


def _read_json(path: str) -> Optional[dict]:
    try:
        data = json.loads(files.read_text(path))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: str, data: dict) -> None:
    files.write_atomic(path, json.dumps(data, indent=2))


def _utc_stamp(now: datetime.datetime) -> str:
    return now.strftime("%Y%m%dT%H%M%SZ")


def check_run_folder(cfg) -> tuple[list[str], list[str]]:
    """Check, without writing, that ``cfg`` may run in ``cfg.run_path``.

    Returns:
      (the earlier run's result entries found, warnings of a resumed run's config changes).

    Raises:
      RunFolderConflict: ``resume="never"`` without ``overwrite`` on a folder holding an
        earlier run's records, or ``resume="auto"`` on a folder of a run with another
        model / data / reward (an :data:`IDENTITY_FIELDS` field; the message names the
        folder, the fields and the ways out).
    """
    from rlflow.config.secrets import redact_config

    run_path = files.absolute(cfg.run_path)
    records = earlier_run_records(run_path)
    warnings: list[str] = []
    if records and cfg.checkpoint.resume == "never":
        if files.is_url(run_path):     # an object store has no folder to move aside
            raise RunFolderConflict(
                f"run folder {run_path} holds an earlier run ({', '.join(records)}); "
                "--checkpoint.resume never will not mix two runs in one folder, and "
                "--checkpoint.overwrite cannot move a folder of an object store aside: pick "
                "a new folder (--name NEW or --run_dir DIR)")
        if not cfg.checkpoint.overwrite:
            raise RunFolderConflict(
                f"run folder {run_path} holds an earlier run ({', '.join(records)}); "
                "--checkpoint.resume never will not mix two runs in one folder. Either pick "
                "a new folder (--name NEW or --run_dir DIR), or add --checkpoint.overwrite "
                f"true to move the earlier run aside to {run_path}.replaced-<time>")
    elif records:                                  # resume "auto": the same run continues
        old_config = _read_json(files.join(run_path, "config.json"))
        if old_config is not None:
            new_config = redact_config(dataclasses.asdict(cfg))
            changed = config_differences(identity_of(old_config), identity_of(new_config))
            if changed:
                raise RunFolderConflict(
                    f"run folder {run_path} holds a run with another "
                    f"{'/'.join(IDENTITY_SECTIONS)} (differs in {', '.join(changed)}); "
                    "resuming would mix two runs. Either pick a new folder (--name NEW or "
                    "--run_dir DIR), or start over with --checkpoint.resume never "
                    "--checkpoint.overwrite true")
            rest = [d for d in config_differences(old_config, new_config)
                    if not _is_identity_field(d)]
            if rest:
                warnings.append(f"run folder {run_path}: resuming with config changes in "
                                f"{', '.join(rest)}")
    return records, warnings


def prepare_run_folder(cfg, *, now: Optional[datetime.datetime] = None) -> PreparedRun:
    """Make ``cfg.run_path`` this run's folder (:func:`check_run_folder`; with
    ``resume="never"`` and ``overwrite`` an earlier run is moved aside) and write
    ``run.json`` at a first start.

    Args:
      cfg: the resolved ``ExperimentConfig`` (``checkpoint.resume``/``overwrite`` decide).
      now: current UTC time (tests pass a fixed one).

    Raises:
      RunFolderConflict: as :func:`check_run_folder`.
    """
    from rlflow.config.secrets import redact_config

    now = now or datetime.datetime.now(datetime.timezone.utc)
    run_path = files.absolute(cfg.run_path)
    records, warnings = check_run_folder(cfg)
    manifest = _read_json(files.join(run_path, RUN_FILE))
    moved_to = None
    if records and cfg.checkpoint.resume == "never":        # overwrite (checked above)
        moved_to = f"{run_path}.replaced-{_utc_stamp(now)}"
        n = 1
        while os.path.exists(moved_to):
            n += 1
            moved_to = f"{run_path}.replaced-{_utc_stamp(now)}-{n}"
        os.replace(run_path, moved_to)
        records, manifest = [], None
    identity = identity_of(redact_config(dataclasses.asdict(cfg)))
    if manifest is None or not records:
        manifest = {"run_id": uuid.uuid4().hex,
                    "created": now.isoformat(timespec="seconds"), "identity": identity}
    else:
        manifest = dict(manifest, identity=identity)
    files.makedirs(run_path)
    _write_json(files.join(run_path, RUN_FILE), manifest)
    return PreparedRun(run_id=str(manifest["run_id"]), moved_to=moved_to,
                       warnings=tuple(warnings))
