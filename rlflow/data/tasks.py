"""Built-in procedural tasks: prompts with a verifiable answer, made from a seed (no download).

The default task, ``digits`` ("next digit"): the prompt is a digit ``d`` followed by ``>``
(``"7>"``), the answer is ``(d + 1) mod 10`` (``"8"``). Its reward ``digits_match`` is
``0.9 * [first character of the completion == answer] + 0.1 * [completion is one character
and ended with a stop token]``: the correctness of the first answer token plus a small
partial credit for stopping right after it (which also keeps generation short). The stop is
the sampler's ``finish_reason``: the decoded text has special tokens removed, so a
completion cut at ``max_tokens`` after ``5`` and three special tokens reads ``"5"`` too.

It is made for the CPU demo: a randomly initialised decoder (hidden 64, 2 layers) with the
task's character tokenizer (15 tokens: 4 specials + ``0-9`` + ``>``; set ``model.vocab_size``
to ``len(tokenizer)``) samples the right digit about 1/15 of the time, so the mean reward
starts near 0.1. In a plain on-policy GRPO reference loop (torch ``LlamaForCausalLM`` of that
size, 1 CPU thread; group size 8, 8 groups per step, lr 1e-3, ``max_tokens`` 4, temperature 1)
the mean reward rose from 0.07-0.09 to 0.97-0.99 between the first and last 10% of 300 steps
(three seeds, ~20 s each); with 16 samples per step (4 groups of 4) the rise was only 0.2-0.3,
so the demo should use about 64 samples per step. No supervised warm-start is needed (a
format-only warm-start did not speed it up).

The multi-turn demo task, ``guess_digit``: the record's ``answer`` is a hidden digit (0-4); the
environment ``guess_digit`` (:mod:`rlflow.envs.guess_digit`) asks ``"?"``, the policy answers
a digit, the environment replies ``"+"`` (higher) or ``"-"`` (lower) until the digit is found
or ``max_turns`` turns are used; the reward comes from the environment. Its tokenizer has the
chat template :data:`rlflow.data.tokenizer.DEFAULT_CHAT_TEMPLATE` (role tokens, each turn
ended by ``<eos>``), 20 tokens.

A task is a :class:`Task`: its record source (``{"prompt", "answer"}`` dicts, record ``i``
a pure function of ``(seed, i)``), its alphabet and the name of its reward function or of
its environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from rlflow.data.tokenizer import DEFAULT_CHAT_TEMPLATE, build_char_tokenizer

#: ``guess_digit_tools``: the default template with tool results rendered as user turns (the
#: 20-token vocabulary has no ``<|tool|>`` token).
TOOLS_CHAT_TEMPLATE = DEFAULT_CHAT_TEMPLATE.replace(
    "<|{{ m['role'] }}|>", "<|{{ 'user' if m['role'] == 'tool' else m['role'] }}|>")


class DigitsSource:
    """``num_records`` "next digit" records; record ``i`` depends only on ``(seed, i)``.

    ``__getitem__(i) -> {"prompt": "7>", "answer": "8"}`` (grain ``RandomAccessDataSource``).
    """

    task = "digits"

    def __init__(self, seed: int, num_records: int = 1024):
        if num_records <= 0:
            raise ValueError(f"{type(self).__name__}: num_records must be > 0, got {num_records}")
        self.seed = int(seed)
        self.num_records = int(num_records)

    def __len__(self) -> int:
        return self.num_records

    def location(self, index: int) -> str:
        return f"builtin task {self.task!r} (seed {self.seed}): record {index}"

    def _digit(self, index: int, high: int = 10) -> int:
        index = int(index)
        if not 0 <= index < self.num_records:
            raise IndexError(f"record {index} out of range [0, {self.num_records})")
        return int(np.random.default_rng([self.seed, index]).integers(high))

    def __getitem__(self, index: int) -> dict:
        d = self._digit(index)
        return {"prompt": f"{d}>", "answer": str((d + 1) % 10)}


class GuessDigitSource(DigitsSource):
    """``num_records`` "guess the digit" records: ``{"prompt": "?", "answer": "3"}``, the
    answer (the hidden digit) uniform in ``0 .. num_values - 1`` (default 0-4; the policy may
    answer any digit 0-9), a pure function of ``(seed, i)``. The environment ``guess_digit``
    plays the episode; ``prompt`` is its first user message."""

    task = "guess_digit"

    def __init__(self, seed: int, num_records: int = 1024, num_values: int = 5):
        super().__init__(seed, num_records)
        if not 1 <= num_values <= 10:
            raise ValueError(f"GuessDigitSource: num_values must be in 1..10, got {num_values}")
        self.num_values = int(num_values)

    def __getitem__(self, index: int) -> dict:
        return {"prompt": "?", "answer": str(self._digit(index, self.num_values))}


def digits_match(completion: str, answer: str, finish_reason: str = "stop") -> float:
    """Reward of the ``digits`` task: 0.9 for a correct first character, 0.1 for stopping.

    Args:
      completion: decoded completion (special tokens removed).
      answer: the reference digit.
      finish_reason: "stop" (ended by a stop token) or "length" (cut at ``max_tokens``).

    Returns:
      ``0.9 * [completion[:1] == answer] + 0.1 * [len(completion.strip()) == 1 and
      finish_reason == "stop"]``, in [0, 1].
    """
    text = completion.strip()
    stopped = finish_reason == "stop" and len(text) == 1
    return 0.9 * float(text[:1] == answer.strip()) + 0.1 * float(stopped)


@dataclass(frozen=True)
class Task:
    """A built-in task.

    Attributes:
      name: ``data.task`` value.
      alphabet: characters of its character tokenizer.
      reward: registry name of its reward function (``reward.functions``); "" for a
        multi-turn task, whose environment gives the reward.
      make_source: ``seed -> source`` of ``{"prompt", "answer"}`` records.
      chat_template: the tokenizer's chat template (None: none; multi-turn tasks need one).
      environment: registry name of its environment (``rlflow.envs``); "" for single-turn.
    """

    name: str
    alphabet: str
    reward: str
    make_source: Callable[[int], object]
    chat_template: Optional[str] = None
    environment: str = ""

    def build_tokenizer(self, out_dir: str):
        """Write the task's character tokenizer (with its chat template, if any) to
        ``out_dir`` and return it."""
        return build_char_tokenizer(self.alphabet, out_dir, chat_template=self.chat_template)


TASKS = {
    "digits": Task(name="digits", alphabet="0123456789>", reward="digits_match",
                   make_source=DigitsSource),
    "guess_digit": Task(name="guess_digit", alphabet="0123456789+-?", reward="",
                        make_source=GuessDigitSource, chat_template=DEFAULT_CHAT_TEMPLATE,
                        environment="guess_digit"),
    # the gateway demo (configs/gateway_demo.py): guess_digit played by an agent program
    "guess_digit_tools": Task(name="guess_digit_tools", alphabet="0123456789+-?", reward="",
                              make_source=GuessDigitSource, chat_template=TOOLS_CHAT_TEMPLATE),
}


def get_task(name: str) -> Task:
    """The built-in task called ``name``.

    Raises:
      KeyError: unknown name (the message lists the known tasks and names ``data.task``).
    """
    if name not in TASKS:
        raise KeyError(f"data.task: unknown built-in task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name]
