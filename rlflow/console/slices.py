"""Check TPU slices against a config before anything is created (``scripts/tpu``, ``scripts/xpk``).

The launch scripts know each slice's shape from its accelerator type (``slice_shape`` in
``scripts/tpu/common.sh``: hosts and chips per host, one JAX device per chip); the config
knows the devices and meshes its programs expect. This module loads the config exactly as
``rlflow train`` will on the hosts (``--config`` plus the overrides after ``--``, and the
``--learner.num_hosts`` / ``--sampler.num_replicas`` the scripts add) and compares:

* learner: ``learner.num_devices`` (= ``learner.mesh`` size, checked by the config) must be
  the learner slice's chips (hosts x chips per host), and ``learner.num_hosts`` its hosts;
* sampler: every sampler host runs one replica, so ``sampler.num_devices`` (= ``sampler.mesh``
  size) must be one sampler host's chips, and ``sampler.num_replicas`` the hosts of all
  sampler slices.

Then the memory model (:mod:`rlflow.console.fit`) against each slice's chips (HBM per chip
of the type): the learner's per-chip terms and a sampler replica's weights and KV cache; a
run that does not fit is refused, naming the setting to change.

Run as ``python -m rlflow.console.slices --learner TYPE HOSTS CHIPS --sampler TYPE HOSTS CHIPS
--sampler-slices K --config PATH -- [rlflow train overrides]``; exit 0 when they match, else
2 with one ``error:`` line per mismatch naming both numbers and the flag that fixes it.

The model folder lives on the hosts (``--model-dir``), not where the scripts run: when
``RLFLOW_MODEL_PATH`` is not a local model folder, the config is loaded against a stand-in
folder (an empty ``config.json``; only the topology is read here).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class Slice:
    """One slice type: ``hosts`` hosts of ``chips`` chips (JAX devices) each."""

    type: str
    hosts: int
    chips: int

    @property
    def devices(self) -> int:
        return self.hosts * self.chips


def slice_mismatches(cfg, learner: Slice, sampler: Slice, sampler_slices: int) -> List[str]:
    """Every way ``cfg`` (an ``ExperimentConfig``) does not fit the slices; [] when it does.

    Each entry names the slice, both numbers and the override that would fit it.
    """
    out = []
    lr, sp = cfg.learner, cfg.sampler
    if lr.num_devices != learner.devices:
        out.append(f"the learner slice {learner.type} has {learner.devices} chips "
                   f"({learner.hosts} host(s) x {learner.chips}) but the config has "
                   f"learner.num_devices={lr.num_devices} (learner.mesh {_mesh(lr.mesh)}); "
                   f"set --learner.num_devices {learner.devices} and a learner.mesh of "
                   f"{learner.devices} devices, or pick a learner type of "
                   f"{lr.num_devices} chips")
    if lr.num_hosts != learner.hosts:
        out.append(f"the learner slice {learner.type} has {learner.hosts} host(s) but the "
                   f"config has learner.num_hosts={lr.num_hosts}")
    if sp.num_devices != sampler.chips:
        out.append(f"each sampler host of {sampler.type} (one replica per host) has "
                   f"{sampler.chips} chips but the config has sampler.num_devices="
                   f"{sp.num_devices} (sampler.mesh {_mesh(sp.mesh)}); set "
                   f"--sampler.num_devices {sampler.chips} and a sampler.mesh of "
                   f"{sampler.chips} devices, or pick a sampler type with "
                   f"{sp.num_devices} chips per host")
    replicas = sampler_slices * sampler.hosts
    if sp.num_replicas != replicas:
        out.append(f"{sampler_slices} sampler slice(s) of {sampler.type} have {replicas} "
                   f"host(s) (one replica each) but the config has sampler.num_replicas="
                   f"{sp.num_replicas}")
    return out


def _mesh(mesh) -> str:
    return mesh.describe()


def _load(config: str, overrides: Sequence[str]):
    """The config ``rlflow train --config config overrides`` builds on the hosts."""
    from rlflow.console.config_args import parse_train_args

    model = os.environ.get("RLFLOW_MODEL_PATH", "")
    if model and os.path.isfile(os.path.join(os.path.expanduser(model), "config.json")):
        return parse_train_args(["--config", config, *overrides])
    with tempfile.TemporaryDirectory(prefix="rlflow-slice-check-") as stand_in:
        with open(os.path.join(stand_in, "config.json"), "w") as f:
            f.write("{}\n")
        os.environ["RLFLOW_MODEL_PATH"] = stand_in
        try:
            return parse_train_args(["--config", config, *overrides])
        finally:
            if model:
                os.environ["RLFLOW_MODEL_PATH"] = model
            else:
                del os.environ["RLFLOW_MODEL_PATH"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: List[str] = []
    if "--" in argv:
        argv, overrides = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(prog="python -m rlflow.console.slices")
    p.add_argument("--learner", nargs=3, metavar=("TYPE", "HOSTS", "CHIPS"), required=True)
    p.add_argument("--sampler", nargs=3, metavar=("TYPE", "HOSTS", "CHIPS"), required=True)
    p.add_argument("--sampler-slices", type=int, required=True)
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    learner = Slice(args.learner[0], int(args.learner[1]), int(args.learner[2]))
    sampler = Slice(args.sampler[0], int(args.sampler[1]), int(args.sampler[2]))
    from rlflow.config import ConfigError
    from rlflow.config.secrets import SecretError

    where = (f"--config {args.config} with the slices' settings (--learner.num_hosts "
             f"{learner.hosts}, --sampler.num_replicas {args.sampler_slices * sampler.hosts})")
    tyro_out = io.StringIO()
    try:
        with contextlib.redirect_stderr(tyro_out), contextlib.redirect_stdout(tyro_out):
            cfg = _load(args.config, overrides)
    except (ConfigError, FileNotFoundError, SecretError) as e:
        print(f"error: {where}: {e}", file=sys.stderr)
        return 2
    except SystemExit:          # tyro: a bad override or a config check; its box as one line
        text = " ".join(re.sub(r"[\u2500-\u257f]|-{3,}", " ", tyro_out.getvalue()).split())
        print(f"error: {where}: {text}", file=sys.stderr)
        return 2
    problems = slice_mismatches(cfg, learner, sampler, args.sampler_slices)
    for problem in problems:
        print(f"error: {problem} (--config {args.config})", file=sys.stderr)
    if problems:
        return 2
    return _check_memory(cfg, learner, sampler, args.config)


def _check_memory(cfg, learner: Slice, sampler: Slice, config: str) -> int:
    """The memory model against the slices' chips (:func:`rlflow.console.fit.check_memory`):
    one ``memory:`` line with the per-chip terms, or the refusal naming the setting (exit
    2); a line saying it was not checked when the model's sizes are unknown here."""
    from rlflow.config import ConfigError
    from rlflow.console import fit

    learner_bytes, sampler_bytes = (fit.device_memory(s.type) for s in (learner, sampler))
    if learner_bytes is None or sampler_bytes is None:
        print(f"memory: not checked (no HBM figure for {learner.type} / {sampler.type})",
              file=sys.stderr)
        return 0
    try:
        found = fit.check_memory(cfg, device_bytes=learner_bytes,
                                 where=fit.chip_name(learner.type),
                                 sampler_device_bytes=sampler_bytes,
                                 sampler_where=fit.chip_name(sampler.type))
    except ConfigError as e:
        print(f"error: {e} (--config {config})", file=sys.stderr)
        return 2
    if found is None:
        print("memory: not checked (runtime.check_memory false, or the model's sizes are "
              "in its folder on the hosts)", file=sys.stderr)
    else:
        print(f"memory: {found.describe()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
