"""Checks of a resolved config that need the file system or the registries.

:class:`rlflow.config.ExperimentConfig` validates values and cross-field constraints in
``__post_init__`` (pure checks, run wherever a config is built). :func:`check_runnable` adds
what needs the machine: the plugins import, every reward function resolves (and can be
loaded by the other programs), the data files (files, not folders) and the model folder
(config.json, safetensors, tokenizer files, a chat template with ``data.chat_template='hf'``;
required for non-built-in data) exist, the built-in task is known, and the sampler can take
the learner's weight layout (a learner-only config, as tests build, need not). The model
folder's config.json must describe a supported architecture, and its tokenizer's ids must
fit the model's vocabulary (a tokenizer larger than the embedding would fail on the first
prompt that uses a new token), and the tokenizer is built, a prompt rendered with the
configured template and encoded, exactly as the programs will (a folder with only
``tokenizer_config.json`` otherwise passes, and the sampler dies in transformers).
``rlflow train`` runs it before it starts any program, so a mistake is refused in seconds
with the field named instead of after the programs have started. :func:`config_warnings`
names settings that run but waste something (printed as warnings; nothing is refused).
"""

from __future__ import annotations

import glob
import os

from rlflow.config import ConfigError, ExperimentConfig
from rlflow.console import file_checks
from rlflow.sampler.memory import kv_cache_bytes


def check_runnable(cfg: ExperimentConfig) -> None:
    """Check what a run needs from this machine before anything starts.

    Raises:
      ConfigError: the message names the field (``plugins``, ``reward.functions``,
        ``data.reasoning_parser``, ``env.name``, ``env.options``, ``data.max_prompt_tokens`` (above
        ``sampler.max_prefill_length`` with ``sampler.on_long_prompt='error'``),
        ``data.path``, ``data.task``, ``model.path``, ``data.chat_template``,
        ``runtime.transfer_layout``, ``sampler.max_tokens`` (a KV cache larger than this
        machine's memory), ``learner.micro_batches`` / ``learner.remat`` /
        ``learner.mesh`` ... (a learner or sampler that does not fit its devices' memory:
        :func:`rlflow.console.fit.check_memory`); with ``eval.every_steps > 0`` the same
        checks of the held-out data and reward functions, named ``eval.path``, ``eval.functions`` ...),
        ``learner.moe_aux_loss_coef`` (set on a dense model), ``learner.lora.targets`` (MLP
        projections of a MoE model),
        ``metrics.wandb.mode`` (W&B on without the ``wandb`` package), ``teacher.path`` (a
        teacher whose tokenizer or vocabulary size differs from the student's,
        :func:`rlflow.learner.teacher.check_teacher_tokenizer`) and what was
        expected (also :mod:`rlflow.console.file_checks`: damaged weight files, an
        ``eval.path`` that is a training file); ``model.path`` / ``data.chat_template``
        also when the tokenizer cannot be built, or a prompt cannot be rendered and
        encoded, the way the programs will (:func:`_check_tokenizer`).
    """
    _check_weight_layout(cfg)
    _check_wandb(cfg)
    _check_plugins(cfg)
    _check_rewards(cfg)
    _check_reasoning_parser(cfg)
    _check_env(cfg)
    _check_data(cfg)
    _check_eval(cfg)
    _check_model(cfg)
    _check_tokenizer(cfg)
    file_checks.check_weights(cfg)
    _check_teacher(cfg)
    _check_kv_cache(cfg)
    _check_memory(cfg)


def _check_memory(cfg) -> None:
    """The learner and the sampler must fit their devices' memory (:mod:`rlflow.console.fit`;
    ``runtime.check_memory=False`` skips it)."""
    from rlflow.console.fit import check_memory

    check_memory(cfg)


def _check_teacher(cfg) -> None:
    """On-policy distillation: the teacher shares the student's tokenizer."""
    if cfg.teacher.enabled:
        from rlflow.learner.teacher import check_teacher_tokenizer

        check_teacher_tokenizer(cfg)


def _check_eval(cfg) -> None:
    """The held-out evaluation's data and reward functions, as the training ones."""
    if not cfg.eval.enabled:
        return
    from rlflow.config.eval import eval_data_config

    if cfg.eval.functions:
        _check_rewards(cfg, cfg.eval.functions, "eval.functions")
    file_checks.check_held_out(cfg)
    _check_data(cfg, eval_data_config(cfg), "eval")


def config_warnings(cfg: ExperimentConfig) -> list[str]:
    """Settings that run but waste something, one sentence each (``rlflow train`` prints
    them before it starts; nothing is refused):

    * greedy sampling (``sampler.temperature=0``) with a group-relative advantage
      (``grpo``, ``drgrpo``, ``rloo``) and ``sampler.group_size > 1``: a group's samples
      are one completion repeated, its advantages are all 0 (GRPO, Shao et al. 2024, eq. 3:
      reward minus the group mean), so no step has a gradient;
    * a LoRA rank above a targeted projection's smaller side, whose update ``A @ B``
      cannot have a higher rank than ``min(in, out)`` (Hu et al. 2021, sec. 4.1): the extra
      rank only costs memory and compute (PEFT allows it too). The model's sizes come from
      ``model.path``'s config.json (no weight is read) or the built-in fields; an
      unreadable config.json gives no warning here (loading the model reports it).
    """
    return _greedy_group_warnings(cfg) + _lora_rank_warnings(cfg)


def _greedy_group_warnings(cfg) -> list[str]:
    sp, adv = cfg.sampler, cfg.learner.advantage
    if sp.temperature > 0 or sp.group_size < 2 or adv == "gae":
        return []
    return [f"sampler.temperature 0 (greedy) gives the {sp.group_size} samples of a group the "
            f"same completion, so learner.advantage={adv!r} (reward minus the group's mean) "
            f"is 0 for every sample and nothing is learned; sample with a temperature > 0"]


def _model_sizes(cfg):
    """The model's ``DecoderConfig`` from ``model.path``'s config.json (no weight is read)
    or the built-in fields; None when that config.json cannot be read (``_check_model`` and
    the programs report it, in full)."""
    from rlflow.models.config import DecoderConfig
    from rlflow.models.hf import read_decoder_config
    try:
        return (read_decoder_config(cfg.model.path) if cfg.model.path
                else DecoderConfig.from_model_config(cfg.model))
    except ValueError:                  # ModelFormatError
        return None


def _lora_rank_warnings(cfg) -> list[str]:
    lora = cfg.learner.lora
    m = _model_sizes(cfg) if lora.enabled else None
    if m is None:
        return []
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    sides = {"q_proj": (m.hidden_size, q), "k_proj": (m.hidden_size, kv),
             "v_proj": (m.hidden_size, kv), "o_proj": (q, m.hidden_size),
             "gate_proj": (m.hidden_size, m.intermediate_size),
             "up_proj": (m.hidden_size, m.intermediate_size),
             "down_proj": (m.intermediate_size, m.hidden_size)}
    over = [f"{p} [{sides[p][0]} -> {sides[p][1]}]" for p in lora.projections
            if lora.rank > min(sides[p])]
    if not over:
        return []
    return [f"learner.lora.rank {lora.rank} is above the smaller side of {', '.join(over)}: "
            f"an adapter's update there has rank at most that side, so the rest of the rank "
            f"only costs memory and compute"]


def _check_kv_cache(cfg) -> None:
    """A sampler KV cache larger than this machine's whole memory (spread over the
    replica's devices) cannot be allocated on any of its devices: refuse it before start-up
    instead of an out-of-memory error from inside the sampler that names no field."""
    from rlflow.system.oom import machine_memory_bytes

    m = _model_sizes(cfg)
    if m is None:
        return
    need, have = kv_cache_bytes(cfg, m), machine_memory_bytes()
    sp = cfg.sampler
    if have is None or need / sp.num_devices <= have:
        return
    if sp.kv_cache == "paged":
        raise ConfigError(
            f"sampler.num_pages: a sampler's paged KV cache would take {need / 1e9:.1f} GB "
            f"({sp.pool_pages} pages x {sp.page_size} positions x {m.num_layers} layers x "
            f"keys and values x {m.num_kv_heads} KV heads x head_dim {m.head_dim}), more than "
            f"this machine's {have / 1e9:.1f} GB of memory over its {sp.num_devices} "
            f"device(s): lower sampler.num_pages")
    raise ConfigError(
        f"sampler.max_tokens: a sampler's KV cache would take {need / 1e9:.1f} GB "
        f"(sampler.num_slots={sp.num_slots} x (max_prefill_length {sp.max_prefill_length} + "
        f"max_tokens {sp.max_tokens}) positions x {m.num_layers} layers x keys and values x "
        f"{m.num_kv_heads} KV heads x head_dim {m.head_dim}), more than this machine's "
        f"{have / 1e9:.1f} GB of memory over its {sp.num_devices} device(s): lower "
        f"sampler.max_tokens or sampler.num_slots")


def _check_weight_layout(cfg) -> None:
    """A one-host learner publishing in its own shard layout ("native") needs samplers with at
    least its devices: else the sampler's first pull fails (``LayoutError``) after start-up."""
    lr, sp, rt = cfg.learner, cfg.sampler, cfg.runtime
    if (rt.weight_transfer == "transfer" and rt.transfer_layout == "native" and
            lr.num_hosts == 1 and sp.num_devices < lr.num_devices):
        raise ConfigError(
            f"runtime.transfer_layout: 'native' makes each sampler pull the weights in the "
            f"learner's shard layout, which needs at least learner.num_devices={lr.num_devices} "
            f"sampler devices, got sampler.num_devices={sp.num_devices}: set "
            f"runtime.transfer_layout='single_device' (the learner gathers each version on one "
            f"device) or give the sampler more devices")


def _check_wandb(cfg) -> None:
    import importlib.util

    if cfg.metrics.wandb.mode != "off" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"metrics.wandb.mode={cfg.metrics.wandb.mode!r} needs the wandb "
                          "package: pip install wandb (or pip install -e '.[wandb]'), or set "
                          "--metrics.wandb.mode off")


def _check_plugins(cfg) -> None:
    from rlflow.system.plugins import PluginError, import_plugins

    try:
        import_plugins(cfg.plugins)
    except PluginError as e:
        raise ConfigError(f"plugins: {e}") from None


def _check_env(cfg) -> None:
    if not cfg.env.enabled:
        return
    from rlflow.envs.base import EnvError, bind_options, get_environment

    try:
        bind_options(get_environment(cfg.env.name), cfg.env.option_dict())
    except EnvError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("env.") else f"env.name: {msg}") from None


def _check_rewards(cfg, names=None, field: str = "reward.functions") -> None:
    from rlflow.config.data import SERVED_REWARDS
    from rlflow.data.http_scorer import ServedRewardError, request_headers
    from rlflow.data.rewards import get_reward
    from rlflow.system.plugins import importable_elsewhere

    for name in cfg.reward.functions if names is None else names:
        if name in SERVED_REWARDS:       # served: its API key must be in the environment
            try:
                request_headers(getattr(cfg.reward, name))
            except ServedRewardError as e:
                raise ConfigError(str(e)) from None
            continue
        try:
            fn = get_reward(name)
        except KeyError as e:
            msg = str(e.args[0]) if e.args else str(e)
            msg = msg.removeprefix("reward.functions: ")
            raise ConfigError(f"{field}: {msg}") from None
        _check_reward_signature(name, fn, field)
        module = getattr(fn, "__module__", "") or ""
        if not importable_elsewhere(module):
            raise ConfigError(
                f"{field}: {name!r} is registered in {module!r} (the --config file "
                f"or __main__), which the sampler program and the reward workers never "
                f"import; move it into a module and list that module in `plugins`, or name "
                f"it 'package.module:function'")


def _check_reasoning_parser(cfg) -> None:
    """A ``module:function`` reasoning parser must load here (as in every program)."""
    from rlflow.data.reasoning import get_reasoning_parser

    try:
        get_reasoning_parser(cfg.data.reasoning_parser)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_reward_signature(name: str, fn, field: str = "reward.functions") -> None:
    """``fn`` must take ``(completion, answer)`` positionally, plus ``finish_reason=`` when it
    names one (how the reward workers call it: :func:`rlflow.data.rewards.call_reward`); a
    callable whose signature cannot be read (a builtin, some C extensions) passes."""
    import inspect

    from rlflow.data.rewards import accepts_finish_reason

    try:
        extra = {"finish_reason": "stop"} if accepts_finish_reason(fn) else {}
        inspect.signature(fn).bind("completion", "answer", **extra)
    except TypeError as e:
        raise ConfigError(f"{field}: {name!r} cannot be called as fn(completion, "
                          f"answer) ({e}; its signature is {inspect.signature(fn)}); a reward "
                          f"function takes the decoded completion and the record's answer and "
                          f"returns a float") from None
    except ValueError:              # no signature to read: the workers will tell
        pass


def _check_data(cfg, d=None, section: str = "data") -> None:
    """``d``: the data section to check (default ``cfg.data``), named ``section`` in errors."""
    d = cfg.data if d is None else d
    sp = cfg.sampler
    if d.max_prompt_tokens > sp.max_prefill_length and sp.on_long_prompt == "error":
        lo, hi = sp.max_prefill_length + 1, d.max_prompt_tokens
        too_long = f"{lo} tokens" if lo == hi else f"{lo}-{hi} tokens"
        raise ConfigError(
            f"{section}.max_prompt_tokens: {d.max_prompt_tokens} is above sampler.max_prefill_length="
            f"{sp.max_prefill_length}, so prompts of {too_long} would pass the data filter and "
            f"stop the sampler (sampler.on_long_prompt='error'); set --{section}.max-prompt-tokens "
            f"{sp.max_prefill_length} (longer prompts are dropped and counted), or raise "
            f"--sampler.max-prefill-length (and --sampler.prefill-buckets), or set "
            f"--sampler.on-long-prompt truncate")
    if d.source == "builtin":
        from rlflow.data.tasks import TASKS

        if d.task not in TASKS:
            raise ConfigError(f"{section}.task: unknown built-in task {d.task!r}; known: "
                              f"{sorted(TASKS)}")
        return
    # The rule of rlflow.data.sources.open_source: a glob, or one path; files only.
    matches = sorted(glob.glob(d.path)) if glob.has_magic(d.path) else [d.path]
    matches = [p for p in matches if os.path.exists(p)]
    folders = [p for p in matches if not os.path.isfile(p)]
    if len(folders) == len(matches):
        what = (f" ({', '.join(folders[:3])} {'is a folder' if len(folders) == 1 else 'are folders'}"
                f"; give the file, or a glob such as {os.path.join(folders[0], '*.' + d.source)!r})"
                if folders else "")
        raise ConfigError(f"{section}.path: no file matches {d.path!r}{what} ({section}.source="
                          f"{d.source!r}; current folder {os.getcwd()})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_moe(cfg, model_type: str) -> None:
    """The learner's mixture-of-experts settings against the model's ``model_type`` (the
    random model's, or ``model.path``'s config.json): ``learner.moe_aux_loss_coef`` needs a
    MoE model (on a dense one it would be ignored); LoRA on a MoE model adapts the attention
    projections only."""
    coef = cfg.learner.moe_aux_loss_coef
    if model_type != "qwen3_moe" and coef is not None:
        where = (f"model.path {cfg.model.path!r} (config.json)" if cfg.model.path
                 else "model.model_type")
        raise ConfigError(f"learner.moe_aux_loss_coef: set to {coef}, but the model is dense "
                          f"(model_type {model_type!r}, {where}): it has no router, so the "
                          f"load-balancing loss would be ignored; leave it unset (None) or "
                          f"train a qwen3_moe model")
    lora = cfg.learner.lora
    mlp = [p for p in lora.projections if p in ("gate_proj", "up_proj", "down_proj")]
    if model_type == "qwen3_moe" and lora.enabled and mlp:
        raise ConfigError(f"learner.lora.targets: selects {', '.join(mlp)}, but the model is "
                          f"a mixture of experts (model_type qwen3_moe), whose MLP projections "
                          f"LoRA does not adapt; target the attention projections only, e.g. "
                          f"--learner.lora.targets q_proj k_proj v_proj o_proj")


def _check_model(cfg) -> None:
    path = cfg.model.path
    if not path:
        if cfg.data.source != "builtin":
            raise ConfigError(f"model.path: required with data.source={cfg.data.source!r} (the "
                              f"prompts are tokenized with the model folder's tokenizer; only "
                              f"built-in tasks bring their own)")
        _check_moe(cfg, cfg.model.model_type)
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.path: {path!r} has no config.json (expected a Hugging Face "
                          f"model folder with config.json and *.safetensors)")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ConfigError(f"model.path: {path!r} has no *.safetensors weights (expected a "
                          f"Hugging Face model folder saved with safetensors)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"model.path: {path!r} has no tokenizer files (one of "
                          f"{', '.join(TOKENIZER_FILES)}); both programs tokenize with it")
    from rlflow.models.hf import read_decoder_config

    try:
        decoder_cfg = read_decoder_config(path)
    except ValueError as e:         # ModelFormatError: names the file and the field
        raise ConfigError(f"model.path: {e}") from None
    vocab = decoder_cfg.vocab_size
    _check_moe(cfg, decoder_cfg.model_type)
    ids = tokenizer_id_count(path)
    if ids is not None and ids > vocab:
        raise ConfigError(f"model.path: the tokenizer of {path!r} has ids up to {ids - 1}, "
                          f"but the model's vocab_size is {vocab} (config.json): token ids "
                          f">= {vocab} have no embedding row. Use the tokenizer the model was "
                          f"trained with, or a model whose vocabulary covers it")
    if cfg.data.chat_template == "hf" and not has_chat_template(path):
        raise ConfigError(f"data.chat_template: 'hf' needs the model folder's chat template, "
                          f"and model.path {path!r} has none (no 'chat_template' in "
                          f"tokenizer_config.json, no {' / '.join(CHAT_TEMPLATE_FILES)}); use "
                          f"--data.chat-template plain (with --data.plain-template) or none, "
                          f"or a model folder with a chat template")


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")

#: What a model folder's tokenizer is built from (transformers' fast tokenizers).
TOKENIZER_EXPECTED = ("tokenizer.json (with tokenizer_config.json), or the files of a slow "
                      "tokenizer with its library installed (tokenizer.model: sentencepiece; "
                      "vocab.json + merges.txt)")

#: The prompt :func:`_check_tokenizer` renders and encodes.
PROBE_PROMPT = "What is 1 + 1?"


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_tokenizer(cfg) -> None:
    """Build the tokenizer exactly as both programs will
    (:func:`rlflow.control.programs_common.run_tokenizer`), then render a prompt with the
    configured template (``data.chat_template``, ``data.plain_template``) and encode it as
    the prompt pipeline does (:class:`rlflow.data.pipeline.PromptFormatter`). A folder
    that merely holds a file with a tokenizer's name (``tokenizer_config.json`` alone, a
    ``tokenizer.model`` without sentencepiece) would otherwise pass and the programs die
    with a transformers traceback. Built-in tasks without ``model.path`` bring their own
    tokenizer (not checked).

    Raises:
      ConfigError: ``model.path`` (the folder, the error in one line, the files expected
        and those found) or ``data.chat_template`` (the template's error on a plain user
        message).
    """
    path = cfg.model.path
    if not path:
        return
    from rlflow.control.programs_common import run_tokenizer

    try:
        tok = run_tokenizer(cfg)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises: one line
        raise _tokenizer_error(path, f"cannot build the tokenizer of {path!r} as the "
                                     f"programs do ({_one_line(e)})") from None
    d = cfg.data
    special = d.chat_template != "hf"      # the template adds BOS itself (as the pipeline)
    text = d.plain_template.format(prompt=PROBE_PROMPT) if d.chat_template != "none" \
        else PROBE_PROMPT
    if d.chat_template == "hf":
        try:
            text = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja2 TemplateError, raise_exception(), ...
            raise ConfigError(f"data.chat_template: the chat template of {path!r} cannot "
                              f"render a user message ({_one_line(e)}); use "
                              f"--data.chat-template plain or none, or fix the template"
                              ) from None
    try:
        ids = tok(text, add_special_tokens=special)["input_ids"]
    except Exception as e:  # noqa: BLE001 - the tokenizer's own error
        raise _tokenizer_error(path, f"the tokenizer of {path!r} cannot encode the prompt "
                                     f"{text!r} ({_one_line(e)})") from None
    if not len(ids):        # e.g. a slow tokenizer class built without its vocabulary file
        raise _tokenizer_error(path, f"the tokenizer of {path!r} encodes the prompt {text!r} "
                                     f"as no tokens")


def _tokenizer_error(path: str, what: str) -> ConfigError:
    """``model.path: <what>; expected <files>; the folder holds [...]`` (one line)."""
    found = sorted(f for f in os.listdir(path) if not f.endswith(".safetensors"))
    return ConfigError(f"model.path: {what}; expected {TOKENIZER_EXPECTED}; the folder holds "
                       f"{found}")


def tokenizer_id_count(path: str):
    """1 + the largest token id of the folder's ``tokenizer.json`` (added tokens included),
    read with the ``tokenizers`` library (no ``transformers`` import); None when the folder
    has no ``tokenizer.json`` or it cannot be read (loading the tokenizer reports that)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    try:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(file).get_vocab(with_added_tokens=True).values()
    except Exception:  # noqa: BLE001 - a broken file is the tokenizer loader's to report
        return None
    return max(ids, default=-1) + 1


def has_chat_template(path: str) -> bool:
    """Whether the Hugging Face folder ``path`` has a chat template, read as transformers
    does without loading it: a non-empty ``chat_template`` in ``tokenizer_config.json``, or
    a ``chat_template.jinja`` / ``chat_template.json`` file."""
    import json

    if any(os.path.isfile(os.path.join(path, f)) for f in CHAT_TEMPLATE_FILES):
        return True
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
