"""The prompt pipeline: records -> chat template -> tokens, shuffled by seed, on grain.

``build_prompt_pipeline(data_cfg, tokenizer, seed=...)`` returns a grain
``DatasetIterator`` and :class:`PromptStats`. Each element is::

    {"prompt_id": int,                 # record index in the source: stable across epochs
     "prompt_tokens": int32 [P],       # 1 <= P <= data.max_prompt_tokens, no padding
     "prompt_text": str,               # the text that was tokenized (template applied)
     "answer": str,                    # reference answer ("" when data.answer_field is "")
     "stream_index": int}              # position in the (shuffled, repeated) prompt stream:
                                       # unique per element, restored with the iterator state

Steps (``grain.MapDataset``): the kept record indices -> ``shuffle`` (a new order each epoch,
seeded by ``(seed, data.shuffle_seed)``) -> ``repeat(data.num_epochs or forever)`` -> ``map``
(read the record, apply the template, tokenize) -> ``to_iter_dataset`` (threaded prefetch).
The iterator's ``get_state()`` is a small JSON-able dict; ``set_state(state)`` on a fresh
iterator of the same pipeline resumes with exactly the elements the saved one would have
yielded next (grain's index-based checkpointing).

Before building, one scan over the dataset (the same ``map``) validates every record and
measures its prompt length, so that bad records, missing fields and over-long prompts are
reported with counts up front, not hours into a run. It tokenizes each prompt once more.

Templates (``data.chat_template``):
  * "hf": ``tokenizer.apply_chat_template([{"role": "user", "content": plain_template.format(
    prompt=...)}], add_generation_prompt=True)``; a prompt field that already holds a list of
    ``{"role": str, "content": str}`` messages is used as is. Tokenized without extra special tokens
    (the template adds BOS if the model wants one).
  * "plain": ``plain_template.format(prompt=...)``, tokenized with the tokenizer's special
    tokens (e.g. BOS).
  * "none": the prompt text as is, tokenized with special tokens.

Errors (``rlflow.data.sources``): BadRecordError / MissingFieldError (file:line, field name;
with ``data.on_bad_record="skip"`` the record is skipped and counted instead),
EmptyDatasetError (no records, or every record bad), AllPromptsFilteredError (every prompt
longer than ``data.max_prompt_tokens``; says how many and the shortest length). An empty
prompt field (whitespace only) is a bad record, and so is every record the tokenizer and
chat template would not take as text: a prompt that is not a string (or, with "hf", not a
non-empty list of messages whose role and content are strings: the template would render
``None`` or ``5`` into the prompt), text that is not valid Unicode (a lone surrogate, which
JSON allows and the Rust tokenizers refuse with a ``TypeError``), and any error the
tokenizer raises on the rendered prompt. These checks run once per record in the scan, so
``data.on_bad_record`` decides for all of them. A prompt whose text is longer than
:func:`rlflow.data.tokenizer.char_bound` characters is counted as too long without being tokenized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import grain
import numpy as np

from rlflow.data.tokenizer import char_bound
from rlflow.data.sources import (BadRecordError, DataError, EmptyDatasetError,
                                 MissingFieldError, open_source, source_files)

logger = logging.getLogger(__name__)

#: Bad-record messages kept in PromptStats.first_bad.
KEEP_BAD_MESSAGES = 5


class AllPromptsFilteredError(DataError):
    """Every prompt is longer than ``data.max_prompt_tokens``."""


@dataclass(frozen=True)
class PromptStats:
    """What the pre-scan found.

    Attributes:
      origin: the files (or built-in task) read.
      num_records: records in the source.
      num_bad: records skipped as bad (``on_bad_record="skip"``).
      num_too_long: prompts longer than ``max_prompt_tokens`` tokens (filtered out).
      num_kept: prompts in one epoch.
      max_prompt_tokens: the length limit, in tokens.
      longest_kept / mean_kept_tokens: prompt lengths of the kept prompts, in tokens.
      first_bad: the first few bad-record messages (file:line and reason).
    """

    origin: str
    num_records: int
    num_bad: int
    num_too_long: int
    num_kept: int
    max_prompt_tokens: int
    longest_kept: int
    mean_kept_tokens: float
    first_bad: Tuple[str, ...] = ()

    def summary(self) -> str:
        return (f"prompts from {self.origin}: {self.num_records} records, {self.num_bad} bad "
                f"(skipped), {self.num_too_long} longer than {self.max_prompt_tokens} tokens "
                f"(filtered), {self.num_kept} kept (longest {self.longest_kept}, "
                f"mean {self.mean_kept_tokens:.1f} tokens)")


class PromptFormatter:
    """Record index -> pipeline element (a pure function of the index; grain ``map``).

    Raises (from ``__call__``): BadRecordError / MissingFieldError naming the record's
    location, the field and what was expected.
    """

    def __init__(self, source, tokenizer, *, prompt_key: str, answer_key: str,
                 chat_template: str, plain_template: str, field_names=("", "")):
        self.source = source
        self.tokenizer = tokenizer
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.chat_template, self.plain_template = chat_template, plain_template
        self._field_names = field_names  # config names for messages ("data.prompt_field")

    def __call__(self, index) -> dict:
        text, special, where, answer = self.render(index)
        return {"prompt_id": int(index), "prompt_tokens": self.tokenize(text, special, where),
                "prompt_text": text, "answer": answer}

    def render(self, index) -> Tuple[str, bool, str, str]:
        """Record ``index`` checked and rendered, not tokenized: the prompt text as the model
        sees it, whether the tokenizer adds its special tokens, the record's location, and
        the answer (a string); errors as :meth:`__call__`."""
        index = int(index)
        where = self.source.location(index)
        record = self.source[index]
        prompt = self._field(record, self.prompt_key, self._field_names[0], where)
        answer = self._field(record, self.answer_key, self._field_names[1], where) \
            if self.answer_key else ""
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise BadRecordError(f"{where}: field {self.answer_key!r} must be a string or a "
                                 f"number, got {type(answer).__name__}")
        text, special = self._render(prompt, where)
        _check_encodable(text, f"{where}: the prompt (field {self.prompt_key!r})")
        return text, special, where, answer

    def tokenize(self, text: str, special: bool, where: str) -> np.ndarray:
        """int32 ``[P]`` ids of a rendered prompt.

        Raises:
          BadRecordError: there are none, or the tokenizer cannot encode the text (any
            error it raises, e.g. ``TypeError`` from the Rust tokenizer on a lone UTF-16
            surrogate, is turned into one naming the record's location).
        """
        try:
            ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses: a bad record
            raise BadRecordError(f"{where}: the tokenizer cannot encode the prompt "
                                 f"({type(e).__name__}: {e})") from None
        if len(ids) == 0:
            raise BadRecordError(f"{where}: the prompt is empty (0 tokens)")
        return np.asarray(ids, dtype=np.int32)

    def _render(self, prompt: Any, where: str) -> Tuple[str, bool]:
        if isinstance(prompt, str) and not prompt.strip():
            raise BadRecordError(f"{where}: field {self.prompt_key!r} is empty (expected the "
                                 f"prompt's text)")
        if self.chat_template == "hf":
            if isinstance(prompt, list):
                messages = _checked_messages(prompt, f"{where}: field {self.prompt_key!r}")
            elif isinstance(prompt, str):
                messages = [{"role": "user", "content": self.plain_template.format(prompt=prompt)}]
            else:
                raise BadRecordError(f"{where}: field {self.prompt_key!r} must be a string or a "
                                     f"list of {{'role', 'content'}} messages, got "
                                     f"{type(prompt).__name__}")
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          tokenize=False)
            except Exception as e:  # jinja2 TemplateError, or raise_exception() in a template
                raise BadRecordError(f"{where}: the tokenizer's chat template failed on this "
                                     f"record ({type(e).__name__}: {e})") from None
            return text, False
        if not isinstance(prompt, str):
            raise BadRecordError(f"{where}: field {self.prompt_key!r} must be a string, got "
                                 f"{type(prompt).__name__} (message lists need "
                                 f"data.chat_template='hf')")
        if self.chat_template == "plain":
            return self.plain_template.format(prompt=prompt), True
        return prompt, True

    @staticmethod
    def _field(record: dict, key: str, config_name: str, where: str):
        if key not in record:
            raise MissingFieldError(f"{where}: missing field {key!r} ({config_name}); the record "
                                    f"has fields {sorted(record)}")
        return record[key]


def _checked_messages(value: list, what: str) -> list:
    """``value`` when it is a non-empty list of ``{"role": str, "content": str}`` messages
    (what a chat template renders; a number, None or a list as content would be rendered
    as its Python text, ``None`` / ``['a']``, into the prompt).

    Raises:
      BadRecordError: names the message index and what is wrong.
    """
    if not value:
        raise BadRecordError(f"{what} is an empty list (expected the prompt's text or a list "
                             f"of {{'role', 'content'}} messages)")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and "role" in m and "content" in m):
            raise BadRecordError(f"{what}: message {i} must be a {{'role', 'content'}} dict, "
                                 f"got {str(m)[:60]!r}")
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise BadRecordError(f"{what}: message {i} {key!r} must be a string, got "
                                     f"{type(m[key]).__name__} {str(m[key])[:40]!r}")
            _check_encodable(m[key], f"{what}: message {i} {key!r}")
    return value


def _check_encodable(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode for a tokenizer (a lone UTF-16 surrogate such as
    ``\\ud800``, which JSON allows and the Rust tokenizers reject with a ``TypeError``).

    Raises:
      BadRecordError: names ``what`` and the character position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecordError(f"{what} holds {text[e.start]!r} at character {e.start}, not "
                             f"valid Unicode text (a lone surrogate); the tokenizer cannot "
                             f"encode it") from None


OVER_CHAR_BOUND = np.iinfo(np.int64).max   # a prompt's length when its text alone is too long


class _Measure:
    """Pre-scan map: index -> prompt length in tokens (:data:`OVER_CHAR_BOUND` for a text
    over ``max_chars`` characters, not tokenized), or the DataError of a bad record."""

    def __init__(self, formatter: PromptFormatter, max_chars: int):
        self.formatter, self.max_chars = formatter, max_chars

    def __call__(self, index):
        try:
            text, special, where, _ = self.formatter.render(index)
            if len(text) > self.max_chars:
                return OVER_CHAR_BOUND
            return len(self.formatter.tokenize(text, special, where))
        except DataError as e:
            return e


def shuffle_seed(seed: int, data_shuffle_seed: int) -> int:
    """The grain shuffle seed for experiment ``seed`` and ``data.shuffle_seed`` (uint32)."""
    return int(np.random.SeedSequence([int(seed), int(data_shuffle_seed)]).generate_state(1)[0])


def make_formatter(data_cfg, tokenizer, *, seed: int) -> Tuple[PromptFormatter, str]:
    """The source (file or built-in task) wrapped as a :class:`PromptFormatter`, and a
    description of where the records come from.

    Raises:
      FileNotFoundError: no file matches ``data.path``.
      KeyError: unknown built-in ``data.task``.
      DataError: ``data.chat_template='hf'`` and the tokenizer has no chat template, or
        ``data.plain_template`` is not a format string with only ``{prompt}``.
    """
    if data_cfg.chat_template == "hf" and not getattr(tokenizer, "chat_template", None):
        raise DataError("data.chat_template='hf' but the tokenizer has no chat template; "
                        "use data.chat_template='plain' or 'none', or a tokenizer with one")
    try:
        data_cfg.plain_template.format(prompt="")
    except (KeyError, IndexError, ValueError) as e:
        raise DataError(f"data.plain_template: must be a format string whose only field is "
                        f"{{prompt}}, got {data_cfg.plain_template!r} ({e!r})") from None
    if data_cfg.source == "builtin":
        from rlflow.data.tasks import get_task

        source = get_task(data_cfg.task).make_source(seed)
        keys, names, origin = ("prompt", "answer"), ("task prompt", "task answer"), \
            f"builtin task {data_cfg.task!r}"
    else:
        source = open_source(data_cfg.source, data_cfg.path)
        keys = (data_cfg.prompt_field, data_cfg.answer_field)
        names, origin = ("data.prompt_field", "data.answer_field"), ", ".join(source_files(source))
    formatter = PromptFormatter(source, tokenizer, prompt_key=keys[0], answer_key=keys[1],
                                chat_template=data_cfg.chat_template,
                                plain_template=data_cfg.plain_template, field_names=names)
    return formatter, origin


def scan(formatter: PromptFormatter, data_cfg, origin: str,
         read_options: Optional[grain.ReadOptions] = None) -> Tuple[np.ndarray, PromptStats]:
    """Validate and measure every record; return the kept record indices (int64 ``[K]``)
    and :class:`PromptStats`.

    Raises:
      BadRecordError / MissingFieldError: first bad record (``on_bad_record="error"``).
      EmptyDatasetError: no records, or all records bad.
      AllPromptsFilteredError: every prompt is longer than ``data.max_prompt_tokens``.
    """
    n = len(formatter.source)
    if n == 0:
        raise EmptyDatasetError(f"the dataset is empty: no records in {origin}")
    max_chars = char_bound(formatter.tokenizer, data_cfg.max_prompt_tokens)
    measured = grain.MapDataset.range(n).map(_Measure(formatter, max_chars)).to_iter_dataset(
        read_options or _read_options())
    lengths = np.full(n, -1, np.int64)
    bad = []
    for i, result in enumerate(measured):
        if isinstance(result, DataError):
            if data_cfg.on_bad_record == "error":
                raise type(result)(f"{result} (set data.on_bad_record='skip' to skip and count "
                                   f"bad records)") from None
            bad.append(str(result))
            if len(bad) <= KEEP_BAD_MESSAGES:
                logger.warning("skipping bad record: %s", result)
        else:
            lengths[i] = result
    if len(bad) == n:
        raise EmptyDatasetError(f"all {n} records in {origin} are bad; first: {bad[0]}")
    good = lengths >= 0
    kept = good & (lengths <= data_cfg.max_prompt_tokens)
    num_too_long = int(good.sum() - kept.sum())
    if not kept.any():
        shortest = int(lengths[good].min())
        shortest = (f"shortest: {shortest} tokens" if shortest != OVER_CHAR_BOUND else
                    f"each over {max_chars} characters")
        raise AllPromptsFilteredError(
            f"all {num_too_long} prompts in {origin} are longer than data.max_prompt_tokens="
            f"{data_cfg.max_prompt_tokens} tokens ({shortest}); "
            f"raise data.max_prompt_tokens (and sampler.max_prefill_length)")
    stats = PromptStats(origin=origin, num_records=n, num_bad=len(bad), num_too_long=num_too_long,
                        num_kept=int(kept.sum()), max_prompt_tokens=data_cfg.max_prompt_tokens,
                        longest_kept=int(lengths[kept].max()),
                        mean_kept_tokens=float(lengths[kept].mean()),
                        first_bad=tuple(bad[:KEEP_BAD_MESSAGES]))
    return np.flatnonzero(kept), stats


def prompt_dataset(data_cfg, tokenizer, *, seed: int,
                   read_options: Optional[grain.ReadOptions] = None
                   ) -> Tuple[grain.MapDataset, PromptStats]:
    """The prompt pipeline as a ``grain.MapDataset`` (before ``to_iter_dataset``) and its stats.

    Args:
      data_cfg: ``rlflow.config.DataConfig``.
      tokenizer: a ``transformers`` tokenizer (``__call__``, ``apply_chat_template``).
      seed: experiment seed: seeds the built-in task's records and, with
        ``data.shuffle_seed``, the shuffle.
      read_options: grain threading for the pre-scan (default 2 threads).

    Raises: as :func:`make_formatter` and :func:`scan`.
    """
    formatter, origin = make_formatter(data_cfg, tokenizer, seed=seed)
    kept, stats = scan(formatter, data_cfg, origin, read_options)
    logger.info("%s", stats.summary())
    ds = (grain.MapDataset.source(kept.tolist())
          .shuffle(seed=shuffle_seed(seed, data_cfg.shuffle_seed))
          .repeat(data_cfg.num_epochs if data_cfg.num_epochs > 0 else None)
          .map(formatter)
          .map_with_index(_with_stream_index))
    return ds, stats


def _with_stream_index(index: int, element: dict) -> dict:
    return {**element, "stream_index": int(index)}


def build_prompt_pipeline(data_cfg, tokenizer, *, seed: int,
                          read_options: Optional[grain.ReadOptions] = None):
    """The prompt iterator and its stats (see the module docstring for the element format).

    Returns:
      ``(iterator, stats)``: a ``grain.DatasetIterator`` (``next()``, ``get_state() -> dict``,
      ``set_state(dict)``; ``StopIteration`` after ``data.num_epochs`` epochs, never when
      ``num_epochs`` is 0) and :class:`PromptStats`.

    Raises: as :func:`prompt_dataset`.
    """
    ds, stats = prompt_dataset(data_cfg, tokenizer, seed=seed, read_options=read_options)
    return iter(ds.to_iter_dataset(read_options or _read_options())), stats


def _read_options() -> grain.ReadOptions:
    # Two threads: prompts are cheap to tokenize and the laptop target has 2 cores.
    return grain.ReadOptions(num_threads=2, prefetch_buffer_size=32)
