"""``rlflow eval``: evaluate a Hugging Face folder or a run's checkpoint on the held-out set.

    rlflow eval --model-path DIR [--config configs/x.py] [--out FILE] [--eval.FIELD V ...]
    rlflow eval --run RUN_FOLDER [--step N] [--base-model DIR] [--out FILE] [--eval.FIELD V ...]

The same code as the evaluation during training: the sampler's engine and continuous batcher
(:mod:`rlflow.sampler.batching`) in this process, the held-out prompts and prompt records of
:mod:`rlflow.eval.scoring`, their requests (:func:`rlflow.sampler.eval_runner.eval_requests`),
the reward functions in reward workers
(:class:`rlflow.data.rewarder.Rewarder`) and the metric functions of
:mod:`rlflow.eval.metrics`. The settings: ``--run`` takes the run's resolved ``config.json``
(its ``eval`` section; the architecture and tokenizer of its base model, ``--base-model``
overriding it) and the checkpoint of ``--step`` (default: the latest); ``--model-path`` takes
``--config`` (default ``configs/demo.py``) with ``model.path`` set to the folder. Any
``--section.field value`` after them overrides a field, as for ``rlflow train``. The metrics
are printed and written as JSON to ``--out`` (default: ``<run>/eval_step_<N>.json`` for
``--run``, ``eval.json`` otherwise), with the first samples of each prompt beside them
(``<out stem>_samples.jsonl``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Optional, Sequence

log = logging.getLogger("rlflow.eval")


class EvalError(ValueError):
    """``rlflow eval`` cannot run (the message names the flag or file and what was expected)."""


def _quiet(text: str) -> None:
    """The default ``say``: phases go nowhere."""


def generate_groups(cfg, requests, params=None, version: int = 0, say=_quiet) -> list:
    """Run ``requests`` to completion on an in-process sampler engine built from ``cfg``
    (``model.path``, ``sampler`` settings: slots, buckets, dtype, mesh over this process's
    first ``sampler.num_devices`` devices); ``params``: an
    ``nnx.State`` to load (None: the model folder's weights), tagged ``version``.
    ``say(text)`` is told each phase (loading, compiling and generating).

    Returns:
      The finished :class:`rlflow.sampler.requests.CompletedGroup` s, in request order.
    """
    from rlflow.mesh import make_mesh
    from rlflow.models.hf import build_model
    from rlflow.control import programs_common as pc
    from rlflow.sampler.batching import ContinuousBatcher
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.precision import sampler_model_config

    import jax

    sc = dataclasses.replace(cfg.sampler, decode_lanes=1)
    mesh = make_mesh(sc.mesh, jax.devices()[:sc.num_devices])   # the first sampler.num_devices
    say(f"loading the model ({cfg.model.path or 'built in'})")
    model, dcfg = build_model(sampler_model_config(cfg), mesh=mesh)
    tokenizer = pc.run_tokenizer(cfg)
    eos = set(dcfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    engine = RlflowEngine(model, sc, mesh=mesh, tokenizer_path=cfg.model.path,
                          eos_token_ids=sorted(eos))
    batcher = ContinuousBatcher(engine, params, version)
    for request in requests:
        batcher.submit(request)
    say(f"compiling prefill and decode, then generating {len(requests)} prompt(s) x "
        f"{cfg.eval.num_samples} sample(s)")
    groups = []
    while batcher.has_work:
        groups += batcher.step()
    order = {id(r): i for i, r in enumerate(requests)}
    return sorted(groups, key=lambda g: order[id(g.request)])


def evaluate(cfg, params=None, version: int = 0, say=_quiet) -> tuple[dict, list]:
    """One evaluation of ``cfg.eval`` on the policy ``params`` (None: ``model.path``'s);
    ``say(text)`` is told each phase (:func:`generate_groups`'s, then scoring).

    Returns:
      ``(metrics, records)``: :func:`rlflow.eval.scoring.aggregate` of the prompt records
      (with ``eval/version``, and the reward calls that failed: ``eval/reward_errors/<fn>``,
      ``eval/reward_timeouts/<fn>``), and the records.

    Raises:
      as :func:`rlflow.eval.scoring.load_eval_prompts`; the reward functions' errors
      (:meth:`rlflow.data.rewarder.Rewarder.score`).
    """
    from rlflow.config.eval import eval_reward_config
    from rlflow.data.reasoning import get_reasoning_parser
    from rlflow.data.rewarder import Rewarder
    from rlflow.eval import scoring
    from rlflow.models.hf import read_decoder_config
    from rlflow.sampler.delivery import graded_texts
    from rlflow.sampler.eval_runner import eval_requests
    from rlflow.control import programs_common as pc

    tokenizer = pc.run_tokenizer(cfg)
    reasoning = get_reasoning_parser(cfg.data.reasoning_parser,
                                     model_type=read_decoder_config(cfg.model.path).model_type
                                     if cfg.model.path else cfg.model.model_type)
    prompts = scoring.load_eval_prompts(cfg, tokenizer)
    requests = eval_requests(cfg, prompts)
    groups = generate_groups(cfg, requests, params, version, say=say)
    reward_cfg = eval_reward_config(cfg)
    say(f"scoring {sum(len(g.completions) for g in groups)} completion(s) with "
        f"{', '.join(reward_cfg.functions)}")
    threshold = pc.accuracy_threshold(reward_cfg)
    records = []
    with Rewarder(reward_cfg, plugins=cfg.plugins) as rewarder:
        for prompt, group in zip(prompts, groups):
            texts, finish, unclosed = graded_texts(group, tokenizer, reasoning)
            rewards, components = scoring.graded_rewards(rewarder.score_group_batch(
                group.prompt_id, texts, prompt["answer"], finish, prompt["prompt_text"]),
                unclosed)
            records.append(scoring.prompt_record(group, texts, rewards, threshold,
                                                 prompt_text=prompt["prompt_text"],
                                                 answer=prompt["answer"],
                                                 components=components))
        # the reward calls that failed (scored 0), named as a run's held-out evaluations
        # name them (rlflow.sampler.eval_runner): eval/reward_timeouts/<fn>, ...
        failures = {"eval/" + k.replace("reward/", "reward_", 1): float(v)
                    for k, v in rewarder.metrics().items()}
    metrics = scoring.aggregate(records)
    metrics.update(failures)
    metrics["eval/version"] = float(version)
    return metrics, records


def _config_and_params(args, rest: Sequence[str], say=_quiet):
    """(config, params, version) for the parsed flags; ``rest``: field overrides."""
    import tyro

    from rlflow.console import file_checks
    from rlflow.console.config_args import DEFAULT_CONFIG, normalize_bools, parse_overrides
    from rlflow.config import load_config_file
    from rlflow.config.secrets import refuse_secret_flags
    from rlflow.control import programs_common as pc

    refuse_secret_flags(rest)
    params, version = None, 0
    if args.run:
        from rlflow.export.hf_folder import params_from_run
        from rlflow.run.metrics import CONFIG_FILE

        path = os.path.join(args.run, CONFIG_FILE)
        if not os.path.isfile(path):
            raise EvalError(f"--run {args.run}: no {CONFIG_FILE} (expected a run folder "
                            "written by rlflow train)")
        cfg = pc.load_config(path)
        say(f"reading the checkpoint ({args.run}, step "
            f"{'latest' if args.step is None else args.step})")
        got = params_from_run(args.run, args.step, base_model=args.base_model)
        if got.lora is not None:
            raise EvalError(f"--run {args.run} is a LoRA run: merge it first (rlflow export "
                            f"--run {args.run} --merge --out DIR), then rlflow eval "
                            "--model-path DIR")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                 path=got.base_model))
        params, version = got.params, got.step
    else:
        cfg = load_config_file(args.config or DEFAULT_CONFIG)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                 path=args.model_path))
    if rest:
        cfg = parse_overrides(tyro, cfg, normalize_bools(rest))
    if args.run:        # the run's own training file, under any spelling, is not held out
        file_checks.check_held_out(cfg, offline=True)
    return cfg, params, version


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry of ``rlflow eval`` (module docstring); returns the exit status (2 with
    the message on stderr on bad input)."""
    from rlflow.checkpoint import CheckpointError
    from rlflow.config import ConfigError
    from rlflow.config.secrets import SecretError
    from rlflow.data.sources import DataError
    from rlflow.eval import scoring
    from rlflow.eval.metrics import metrics_line
    from rlflow.export.hf_folder import ExportError
    from rlflow.models.config import ModelFormatError

    parser = argparse.ArgumentParser(
        prog="rlflow eval",
        description="Evaluate a Hugging Face folder or a run's checkpoint on the held-out set "
                    "(the eval section of the config).",
        epilog="Any --SECTION.FIELD VALUE after these overrides a config field, e.g. "
               "--eval.path test.jsonl --eval.num-prompts 64 --eval.num-samples 4 "
               "--eval.temperature 0.7 (every field: docs/config.md).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path", default="", help="Hugging Face model folder")
    source.add_argument("--run", default="", help="run folder (evaluates a checkpoint)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step of --run "
                        "(default: the latest)")
    parser.add_argument("--base-model", default="", help="with --run: the base model folder "
                        "(default: model.path of the run's config)")
    parser.add_argument("--config", default="", help="with --model-path: config file for the "
                        "eval settings (default: configs/demo.py)")
    parser.add_argument("--out", default="", help="JSON file for the metrics")
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.run and args.config:
        print("rlflow eval: --config is for --model-path; --run uses the run's config.json "
              "(override fields with --eval.FIELD VALUE)", file=sys.stderr)
        return 2
    try:
        def say(text: str) -> None:     # the phases, on stderr (stdout: the figures)
            print(f"rlflow eval: {text}", file=sys.stderr, flush=True)

        cfg, params, version = _config_and_params(args, rest, say)
        metrics, records = evaluate(cfg, params, version, say=say)
    except (EvalError, ConfigError, SecretError, DataError, ExportError, CheckpointError,
            ModelFormatError, FileNotFoundError) as e:
        print(f"rlflow eval: {e}", file=sys.stderr)
        return 2
    out = args.out or (os.path.join(args.run, f"eval_step_{version}.json") if args.run
                       else "eval.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    body = {"source": args.run or args.model_path, "step": version if args.run else None,
            "metrics": metrics, "eval": dataclasses.asdict(cfg.eval)}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2)
        f.write("\n")
    samples = os.path.splitext(out)[0] + "_samples.jsonl"
    if os.path.exists(samples):
        os.remove(samples)
    scoring.write_eval_samples(os.path.dirname(os.path.abspath(samples)), version, records,
                               cfg.eval.num_logged_samples, name=os.path.basename(samples))
    print(metrics_line(metrics))
    print(f"rlflow eval: metrics written to {out}")
    return 0
