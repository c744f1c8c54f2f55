"""The grain prompt pipeline: element format, templates, shuffle/epochs, length filter, and
exact resume from a saved iterator state (mid-epoch and at an epoch boundary).

Oracles are independent of the code under test: records are read back with ``json``, token
ids come from calling the tokenizer directly on the expected text, lengths for the filter
from that same direct tokenization.
"""

import json
import re
import string

import numpy as np
import pytest

from rlflow.config import DataConfig
from rlflow.data.pipeline import AllPromptsFilteredError, build_prompt_pipeline
from rlflow.data.sources import DataError
from rlflow.data.tokenizer import DEFAULT_CHAT_TEMPLATE, build_char_tokenizer

ALPHABET = string.ascii_letters + string.digits + " ?.,:'\n"
N = 11


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(ALPHABET, str(tmp_path_factory.mktemp("tok")),
                                chat_template=DEFAULT_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def records():
    rng = np.random.default_rng(0)
    words = ["apple", "pear", "count", "sum", "of", "the", "is", "what"]
    return [{"question": " ".join(rng.choice(words, size=int(rng.integers(1, 8)))) + "?",
             "answer": str(i * 7)} for i in range(N)]


@pytest.fixture(scope="module")
def path(tmp_path_factory, records):
    p = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(p)


def cfg(path, **kw):
    return DataConfig(source="jsonl", path=path, **kw)


def ids(it, n):
    return [next(it)["prompt_id"] for _ in range(n)]


def test_elements_match_records_and_direct_tokenization(path, records, tok):
    it, stats = build_prompt_pipeline(cfg(path, num_epochs=1, chat_template="plain",
                                          plain_template="Q: {prompt}\nA:"), tok, seed=0)
    got = list(it)
    assert stats.num_kept == N and len(got) == N
    assert sorted(e["prompt_id"] for e in got) == list(range(N))
    for e in got:
        rec = records[e["prompt_id"]]
        text = f"Q: {rec['question']}\nA:"
        assert e["prompt_text"] == text and e["answer"] == rec["answer"]
        assert e["prompt_tokens"].dtype == np.int32 and e["prompt_tokens"].ndim == 1
        assert e["prompt_tokens"].tolist() == tok(text)["input_ids"]
        assert e["prompt_tokens"][0] == tok.bos_token_id  # "plain" keeps special tokens


def test_hf_chat_template_and_message_lists(tmp_path, tok):
    rows = [{"question": "sum of apples?", "answer": "3"},
            {"question": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "what is it?"}], "answer": "4"}]
    p = tmp_path / "chat.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    it, _ = build_prompt_pipeline(cfg(str(p), num_epochs=1, chat_template="hf",
                                      plain_template="{prompt} Think."), tok, seed=0)
    got = {e["prompt_id"]: e for e in it}
    want = ["<bos><|user|>sum of apples? Think.<eos><|assistant|>",
            "<bos><|system|>be brief<eos><|user|>what is it?<eos><|assistant|>"]
    for i, text in enumerate(want):
        assert got[i]["prompt_text"] == text
        assert got[i]["prompt_tokens"].tolist() == tok(text, add_special_tokens=False)["input_ids"]
        assert got[i]["prompt_tokens"].tolist().count(tok.bos_token_id) == 1


def test_template_errors(path, tmp_path):
    plain = build_char_tokenizer(ALPHABET, str(tmp_path / "plain"))  # no chat template
    with pytest.raises(DataError, match=r"data\.chat_template='hf' but the tokenizer has no"):
        build_prompt_pipeline(cfg(path, chat_template="hf"), plain, seed=0)
    with pytest.raises(DataError, match=r"data\.plain_template: .*only field is \{prompt\}"):
        build_prompt_pipeline(cfg(path, chat_template="plain", plain_template="{prompt} {x}"),
                              plain, seed=0)


def test_chat_template_failure_is_a_bad_record_naming_the_line(tmp_path):
    from rlflow.data.sources import BadRecordError

    strict = build_char_tokenizer("ab", str(tmp_path / "strict"), chat_template=(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"))
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"question": "ab", "answer": "1"}) + "\n" + json.dumps(
        {"question": [{"role": "tool", "content": "a"}], "answer": "2"}) + "\n")
    with pytest.raises(BadRecordError, match=r"m\.jsonl:2: the tokenizer's chat template failed"
                                             r".*no tools"):
        build_prompt_pipeline(cfg(str(p), chat_template="hf"), strict, seed=0)


def test_each_epoch_is_a_fresh_permutation_and_epochs_end(path, tok):
    it, _ = build_prompt_pipeline(cfg(path, num_epochs=3), tok, seed=0)
    order = ids(it, 3 * N)
    epochs = [order[k * N:(k + 1) * N] for k in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(N))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert epochs[0] != list(range(N))
    with pytest.raises(StopIteration):
        next(it)


def test_order_is_deterministic_given_the_seeds(path, tok):
    def order(seed, shuffle_seed):
        it, _ = build_prompt_pipeline(cfg(path, shuffle_seed=shuffle_seed), tok, seed=seed)
        return ids(it, 2 * N)

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)


@pytest.mark.parametrize("stop_at", [4, N, 2 * N - 1], ids=["mid-epoch", "epoch-boundary",
                                                            "end-of-epoch-2"])
def test_restored_iterator_yields_what_an_uninterrupted_one_would(path, tok, stop_at):
    data_cfg = cfg(path, num_epochs=3)
    full, _ = build_prompt_pipeline(data_cfg, tok, seed=5)
    reference = [(e["prompt_id"], e["prompt_tokens"].tolist(), e["stream_index"]) for e in full]
    assert len(reference) == 3 * N
    assert [r[2] for r in reference] == list(range(3 * N))     # position in the stream

    first, _ = build_prompt_pipeline(data_cfg, tok, seed=5)
    head = [next(first)["prompt_id"] for _ in range(stop_at)]
    state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores
    del first

    resumed, _ = build_prompt_pipeline(data_cfg, tok, seed=5)
    resumed.set_state(state)
    tail = [(e["prompt_id"], e["prompt_tokens"].tolist(), e["stream_index"]) for e in resumed]
    assert head == [r[0] for r in reference[:stop_at]]
    assert tail == reference[stop_at:]


def test_length_filter_counts_against_direct_tokenization(path, records, tok):
    lengths = np.array([len(tok(r["question"])["input_ids"]) for r in records])
    limit = int(np.median(lengths))
    it, stats = build_prompt_pipeline(cfg(path, num_epochs=1, max_prompt_tokens=limit), tok,
                                      seed=0)
    kept = sorted(e["prompt_id"] for e in it)
    assert kept == np.flatnonzero(lengths <= limit).tolist()
    assert stats.num_too_long == int((lengths > limit).sum()) > 0
    assert stats.num_kept == len(kept) and stats.longest_kept == lengths[lengths <= limit].max()
    assert f"{stats.num_too_long} longer than {limit} tokens" in stats.summary()


def test_all_prompts_filtered_says_so_and_how_many(path, records, tok):
    shortest = min(len(tok(r["question"])["input_ids"]) for r in records)
    with pytest.raises(AllPromptsFilteredError,
                       match=rf"all {N} prompts .* longer than data\.max_prompt_tokens="
                             rf"{shortest - 1} tokens \(shortest: {shortest} tokens\)"):
        build_prompt_pipeline(cfg(path, max_prompt_tokens=shortest - 1), tok, seed=0)


UNENCODABLE = [  # (prompt field, what the error says): issue 39.5
    (7, "must be a string"), (None, "must be a string"), (["a", "b"], "message 0 must be a"),
    ([{"role": "user", "content": 5}], "message 0 'content' must be a string, got int"),
    ([{"role": "user", "content": None}], "message 0 'content' must be a string, got NoneType"),
    ([{"role": 3, "content": "a"}], "message 0 'role' must be a string, got int"),
    ([], "is an empty list"),
    ("ab\ud800", "holds '\\ud800' at character"),           # JSON allows a lone surrogate
    ([{"role": "user", "content": "a\udfff"}], "message 0 'content' holds '\\udfff'"),
]


@pytest.mark.parametrize("template", ["hf", "plain", "none"])
def test_records_the_tokenizer_cannot_encode_follow_on_bad_record(tmp_path, tok, template):
    """Issue 39.5: a prompt that is a number, None, a list of non-messages, messages with a
    non-string role or content (which the template would render as "None", "5"), or text
    the Rust tokenizer refuses (a lone surrogate: TypeError, no file:line) is a bad record:
    error names the file:line, skip counts it."""
    rows = [{"question": "sum of apples?", "answer": "1"}] + [
        {"question": q, "answer": str(i)} for i, (q, _) in enumerate(UNENCODABLE)]
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for line, (prompt, message) in enumerate(UNENCODABLE, start=2):
        if template != "hf" and isinstance(prompt, list):
            message = "must be a string"           # message lists need the hf template
        one = tmp_path / f"one{line}.jsonl"
        one.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[line - 1]) + "\n")
        with pytest.raises(DataError, match=rf"one{line}\.jsonl:2: .*{re.escape(message)}"):
            build_prompt_pipeline(cfg(str(one), chat_template=template), tok, seed=0)
    it, stats = build_prompt_pipeline(cfg(str(p), num_epochs=1, on_bad_record="skip",
                                          chat_template=template), tok, seed=0)
    assert stats.num_bad == len(UNENCODABLE)
    assert [e["prompt_id"] for e in it] == [0]


def test_a_tokenizer_error_is_a_bad_record_naming_the_line(tmp_path, tok):
    """Whatever the tokenizer raises on a rendered prompt becomes a BadRecordError with the
    record's location (here a tokenizer that refuses one text)."""
    from rlflow.data.sources import BadRecordError

    class Refuses:
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            if "pear" in text:
                raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
            return tok(text, add_special_tokens=add_special_tokens)

        def __getattr__(self, name):
            return getattr(tok, name)

    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"question": "apple", "answer": "1"}) + "\n"
                 + json.dumps({"question": "pear", "answer": "2"}) + "\n")
    with pytest.raises(BadRecordError, match=r"t\.jsonl:2: the tokenizer cannot encode the "
                                             r"prompt \(TypeError: TextEncodeInput"):
        build_prompt_pipeline(cfg(str(p), chat_template="none"), Refuses(), seed=0)


def test_empty_prompt_is_a_bad_record(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    no_bos = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")  # adds nothing
    p = tmp_path / "e.jsonl"
    p.write_text(json.dumps({"question": "a b", "answer": "1"}) + "\n"
                 + json.dumps({"question": "", "answer": "2"}) + "\n"
                 + json.dumps({"question": " \n ", "answer": "3"}) + "\n")
    for template in ("none", "plain", "hf"):
        with pytest.raises(DataError, match=r"e\.jsonl:2: field 'question' is empty"):
            build_prompt_pipeline(cfg(str(p), chat_template=template), tok_with_template(no_bos),
                                  seed=0)
    it, stats = build_prompt_pipeline(cfg(str(p), num_epochs=1, on_bad_record="skip",
                                          chat_template="none"), no_bos, seed=0)
    assert stats.num_bad == 2 and [e["prompt_tokens"].tolist() for e in it] == [[1, 2]]


def tok_with_template(tokenizer):
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def test_a_prompt_too_long_in_characters_is_never_tokenized(tmp_path, tok):
    """A 2M-character line is counted as too long without reaching the tokenizer (which
    needs hundreds of times a text's size); the other records are measured as usual."""
    from rlflow.data.pipeline import char_bound

    seen = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, text, **kw):
            seen.append(len(text))
            return self.inner(text, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    p = tmp_path / "huge.jsonl"
    p.write_text(json.dumps({"question": "what is the sum?", "answer": "1"}) + "\n"
                 + json.dumps({"question": "a" * 2_000_000, "answer": "2"}) + "\n")
    limit = 64
    assert char_bound(tok, limit) < 2_000_000
    it, stats = build_prompt_pipeline(cfg(str(p), num_epochs=1, max_prompt_tokens=limit,
                                          chat_template="none"), Spy(tok), seed=0)
    assert stats.num_too_long == 1 and stats.num_kept == 1
    assert [e["prompt_id"] for e in it] == [0]
    assert max(seen) < 100                          # the long text was never tokenized
    only = tmp_path / "only_huge.jsonl"
    only.write_text(p.read_text().splitlines()[1] + "\n")
    with pytest.raises(AllPromptsFilteredError, match=rf"\(each over "
                                                      rf"{char_bound(tok, limit)} characters\)"):
        build_prompt_pipeline(cfg(str(only), max_prompt_tokens=limit, chat_template="none"),
                              Spy(tok), seed=0)


def test_numeric_answers_become_strings_and_no_answer_field_gives_empty(tmp_path, tok):
    p = tmp_path / "n.jsonl"
    p.write_text(json.dumps({"question": "a", "answer": 12}) + "\n")
    it, _ = build_prompt_pipeline(cfg(str(p), num_epochs=1), tok, seed=0)
    assert next(it)["answer"] == "12"
    it, _ = build_prompt_pipeline(cfg(str(p), num_epochs=1, answer_field=""), tok, seed=0)
    assert next(it)["answer"] == ""


def test_builtin_task_pipeline(tmp_path):
    from rlflow.data.tasks import get_task

    task_tok = get_task("digits").build_tokenizer(str(tmp_path / "digits"))
    it, stats = build_prompt_pipeline(DataConfig(), task_tok, seed=0)
    assert stats.num_kept == stats.num_records > 0
    for _ in range(20):
        e = next(it)
        d = int(e["prompt_text"][0])
        assert e["prompt_text"] == f"{d}>" and e["answer"] == str((d + 1) % 10)
        assert e["prompt_tokens"].tolist() == task_tok(f"{d}>")["input_ids"]
