"""The built-in ``digits`` task, its reward, and the local tokenizer builders."""

import json
import os

import numpy as np
import pytest

from rlflow.config import DataConfig, RewardConfig
from rlflow.data.rewarder import Rewarder
from rlflow.data.rewards import get_reward
from rlflow.data.tasks import TASKS, DigitsSource, digits_match, get_task
from rlflow.data.tokenizer import (DEFAULT_CHAT_TEMPLATE, build_bpe_tokenizer,
                                   build_char_tokenizer, load_tokenizer)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
GSM8K_TEST = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "gsm8k", "test.jsonl"))


def test_digits_records_are_deterministic_and_correct():
    a, b, c = DigitsSource(seed=0, num_records=200), DigitsSource(seed=0, num_records=200), \
        DigitsSource(seed=1, num_records=200)
    ra = [a[i] for i in range(len(a))]
    assert ra == [b[i] for i in range(len(b))]
    assert ra != [c[i] for i in range(len(c))]
    digits = []
    for r in ra:
        assert len(r["prompt"]) == 2 and r["prompt"][1] == ">"
        d = int(r["prompt"][0])
        assert r["answer"] == str((d + 1) % 10)
        digits.append(d)
    counts = np.bincount(digits, minlength=10)
    assert counts.min() > 0  # every digit appears in 200 records
    with pytest.raises(IndexError):
        a[200]


@pytest.mark.parametrize("completion, want", [
    ("8", 1.0), (" 8\n", 1.0), ("89", 0.9), ("8>>>", 0.9), ("7", 0.1), ("", 0.0), ("78", 0.0),
])
def test_digits_match(completion, want):
    assert digits_match(completion, "8") == pytest.approx(want)
    assert digits_match(completion, "8", finish_reason="stop") == pytest.approx(want)


@pytest.mark.parametrize("completion, want", [("8", 0.9), (" 8\n", 0.9), ("7", 0.0), ("89", 0.9)])
def test_digits_match_pays_no_stop_credit_for_a_completion_cut_at_max_tokens(completion, want):
    """Issue 39.1: ``8`` then special tokens up to ``max_tokens`` decodes to ``"8"``, like
    ``8<eos>``; only the finish reason tells them apart."""
    assert digits_match(completion, "8", finish_reason="length") == pytest.approx(want)


def test_default_config_names_the_task_and_its_reward():
    task = get_task(DataConfig().task)
    assert task.reward in RewardConfig().functions
    assert get_reward(task.reward) is digits_match
    with pytest.raises(KeyError, match=r"data\.task: unknown built-in task 'nope'.*digits"):
        get_task("nope")


def test_task_tokenizer_round_trips_every_prompt_and_answer(tmp_path):
    task = TASKS["digits"]
    tok = task.build_tokenizer(str(tmp_path / "tok"))
    again = load_tokenizer(str(tmp_path / "tok"))
    assert len(tok) == len(again) == 4 + len(task.alphabet)
    ids_of = {ch: tok.convert_tokens_to_ids(ch) for ch in task.alphabet}
    assert len(set(ids_of.values())) == len(task.alphabet) and min(ids_of.values()) >= 4
    src = task.make_source(0)
    for i in range(30):
        r = src[i]
        ids = again(r["prompt"])["input_ids"]
        assert ids == [tok.bos_token_id] + [ids_of[ch] for ch in r["prompt"]]
        assert again.decode(ids, skip_special_tokens=True) == r["prompt"]
    # a completion "8<eos>" decodes to the text the reward sees
    completion = [ids_of["8"], tok.eos_token_id]
    assert tok.decode(completion, skip_special_tokens=True) == "8"
    r = Rewarder(RewardConfig())
    assert r.score_group(0, [tok.decode(completion, skip_special_tokens=True)], "8").tolist() \
        == [1.0]


def test_char_tokenizer_with_chat_template(tmp_path):
    tok = build_char_tokenizer("ab ", str(tmp_path / "c"), chat_template=DEFAULT_CHAT_TEMPLATE)
    assert os.path.isfile(tmp_path / "c" / "tokenizer.json")
    text = tok.apply_chat_template([{"role": "user", "content": "ab a"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|user|>ab a<eos><|assistant|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    role = tok.convert_tokens_to_ids
    assert ids == [tok.bos_token_id, role("<|user|>"), role("a"), role("b"), role(" "), role("a"),
                   tok.eos_token_id, role("<|assistant|>")]
    assert tok("abc")["input_ids"][-1] == tok.unk_token_id  # outside the alphabet
    with pytest.raises(ValueError, match="alphabet must not be empty"):
        build_char_tokenizer("", str(tmp_path / "e"))


def test_bpe_tokenizer_on_gsm8k_questions(tmp_path):
    if not os.path.isfile(GSM8K_TEST):
        pytest.skip(f"GSM8K test file not found at {GSM8K_TEST} (expected <repo>/../shared/data)")
    with open(GSM8K_TEST) as f:
        questions = [json.loads(line)["question"] for line in f][:400]
    tok = build_bpe_tokenizer(questions, str(tmp_path / "bpe"), vocab_size=400)
    assert 263 < len(tok) <= 400
    for q in questions[:50]:
        ids = tok(q)["input_ids"]
        assert ids[0] == tok.bos_token_id and len(ids) < len(q.encode("utf-8"))  # merges learned
        assert tok.decode(ids, skip_special_tokens=True) == q
    with pytest.raises(ValueError, match=r"vocab_size must be >= 263"):
        build_bpe_tokenizer(questions, str(tmp_path / "small"), vocab_size=100)


def test_load_tokenizer_names_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer folder not found"):
        load_tokenizer(str(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))


def test_load_tokenizer_of_a_generic_folder_skips_torch_and_equals_autotokenizer(tmp_path,
                                                                                 monkeypatch):
    """rlflow's saved tokenizers load with PreTrainedTokenizerFast (no torch import in a
    fresh process) and behave as AutoTokenizer's; a folder naming another class still goes
    through AutoTokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    path = str(tmp_path / "c")
    build_char_tokenizer("ab =+0123", path, chat_template=DEFAULT_CHAT_TEMPLATE)
    probe = ("import sys; from rlflow.data.tokenizer import load_tokenizer; "
             f"t = load_tokenizer({path!r}); print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[-1] == "False", out
    fast, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(fast) is type(auto) and out[0] == type(auto).__name__
    chat = [{"role": "user", "content": "1+2 ="}]
    assert fast("ab =+9")["input_ids"] == auto("ab =+9")["input_ids"]
    assert fast.special_tokens_map == auto.special_tokens_map and len(fast) == len(auto)
    assert fast.apply_chat_template(chat, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, add_generation_prompt=True)

    config = json.load(open(os.path.join(path, "tokenizer_config.json")))
    json.dump({**config, "tokenizer_class": "SomeModelTokenizer"},
              open(os.path.join(path, "tokenizer_config.json"), "w"))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda p: ("auto", p))
    assert load_tokenizer(path) == ("auto", path)
