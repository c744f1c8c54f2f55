"""Multi-turn token rendering (rlflow.envs.chat) and the guess_digit demo environment.

The mask oracle is independent of ChatRenderer.continuation_ids: it locates each assistant
message's content and end-of-turn token in the template's own rendering of the final
conversation (from the rendering of the prefix before it) and marks the tokens whose
characters fall inside those spans.
"""

import pytest

from chat_fixtures import tiny_tokenizer
from rlflow.envs import EnvError, get_environment, registered_environments
from rlflow.envs.chat import ChatRenderer, ChatTemplateError, episode_mask

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return its output.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}

# (messages before the first assistant turn, then per turn: assistant text, env messages)
EPISODE = (
    [{"role": "system", "content": "You are a helpful assistant. Use the python tool."},
     {"role": "user", "content": "What is 12 times 7?"}],
    [('<tool_call>\n{"name": "python", "arguments": {"code": "print(12*7)"}}\n</tool_call>',
      [{"role": "tool", "content": "84"}]),
     ("Let me check with a guess: 85.", [{"role": "user", "content": "lower"},
                                          {"role": "user", "content": "Answer with the number."}]),
     ("The answer is 84. #### 84", None)],
)


def simulate(renderer, tokenizer, first, turns, tools=None):
    """A sampler's episode: prompt, then per turn the sampled ids (encode(text) + <eot>) and
    the continuation. Returns (ids, mask, final conversation)."""
    messages = list(first)
    segments = [(renderer.prompt_ids(messages, tools=tools), False)]
    for text, new in turns:
        sampled = tokenizer.encode(text, add_special_tokens=False) + [renderer.turn_end_id]
        segments.append((sampled, True))
        assert renderer.assistant_text(sampled) == text
        messages.append({"role": "assistant", "content": renderer.assistant_text(sampled)})
        if new is not None:
            segments.append((renderer.continuation_ids(messages, new, tools=tools), False))
            messages.extend(new)
    ids, mask = episode_mask(segments)
    return ids, mask, messages


def oracle_mask(renderer, tokenizer, ids, messages, tools=None):
    """1 on tokens inside [start of assistant content, end of its <eot>) in the rendering."""
    eot = tokenizer.convert_ids_to_tokens(renderer.turn_end_id)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(renderer.render(messages[:i], tools=tools, add_generation_prompt=True))
            spans.append((start, start + len(m["content"]) + len(eot)))
    mask, pos = [], 0
    for t in ids:
        n = len(tokenizer.decode([t]))
        mask.append(int(any(a <= pos and pos + n <= b for a, b in spans)))
        assert not any(a < pos + n and pos < b and not (a <= pos and pos + n <= b)
                       for a, b in spans), "a token straddles a span boundary"
        pos += n
    return mask


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def chat(request):
    tok = tiny_tokenizer(request.param)
    return request.param, tok, ChatRenderer(tok)


def test_episode_mask_and_text_match_the_template(chat):
    kind, tok, renderer = chat
    tools = [PYTHON_TOOL] if kind == "chatml" else None
    first, turns = EPISODE
    ids, mask, messages = simulate(renderer, tok, first, turns, tools)
    assert mask == oracle_mask(renderer, tok, ids, messages, tools)
    assert sum(mask) == sum(len(tok.encode(t, add_special_tokens=False)) + 1 for t, _ in turns)
    final = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                    add_generation_prompt=False)
    # the episode ends on the sampled end-of-turn token: the template's trailing scaffold
    # (ChatML "\n", Llama-3 none) is not part of it
    assert final == tok.decode(ids) + renderer.scaffold
    assert renderer.scaffold == {"chatml": "\n", "llama3": ""}[kind]
    header = {"chatml": "<|im_start|>assistant", "llama3": "<|start_header_id|>assistant"}[kind]
    assert tok.decode(ids).count(header) == len(turns)
    # sampled ids are kept as they were sampled (never re-tokenized)
    sampled = [t for t, m in zip(ids, mask) if m]
    expected = sum((tok.encode(t, add_special_tokens=False) + [renderer.turn_end_id]
                    for t, _ in turns), [])
    assert sampled == expected


def test_end_of_turn_ids(chat):
    kind, tok, renderer = chat
    eot = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}[kind]
    assert renderer.turn_end_id == tok.convert_tokens_to_ids(eot)
    assert renderer.end_of_turn_ids[0] == renderer.turn_end_id
    assert tok.eos_token_id in renderer.end_of_turn_ids


CHATML_HISTORY = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ CONTENT }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{{ GEN }}"
                  "{% endif %}")


def chatml_variant(content: str, gen: str = ""):
    tok = tiny_tokenizer("chatml")
    tok.chat_template = CHATML_HISTORY.replace("{{ CONTENT }}", content).replace("{{ GEN }}", gen)
    return tok


def test_templates_that_rewrite_history():
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "12"}]
    new = [{"role": "user", "content": "lower"}]
    # generation prompt != the assistant header in history (Qwen3 with thinking off)
    with pytest.raises(ChatTemplateError, match="does not extend"):
        ChatRenderer(chatml_variant("{{ m['content'] }}", gen="<think>\n\n</think>\n\n"))
    # an earlier turn rendered differently once later messages come
    renderer = ChatRenderer(chatml_variant(
        "{{ m['content'] }}{% if messages|length > 2 and loop.first %} (first){% endif %}"))
    with pytest.raises(ChatTemplateError, match="does not extend"):
        renderer.continuation_ids(convo, new)
    with pytest.raises(ChatTemplateError, match="assistant message just sampled"):
        renderer.continuation_ids(convo[:1], new)
    # assistant content dropped from history: counted, or refused when strict
    dropping = "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
    renderer = ChatRenderer(chatml_variant(dropping))
    tok = renderer.tokenizer
    cont = renderer.continuation_ids(convo, new)
    assert tok.decode(cont) == "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.content_mismatches == 1
    with pytest.raises(ChatTemplateError, match="differently"):
        ChatRenderer(tok, strict=True).continuation_ids(convo, new)
    # only the last assistant message decorated (Qwen3's empty think block): continued as is
    last = ("{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
            "{{ m['content'] }}")
    renderer = ChatRenderer(chatml_variant(last), strict=True)
    assert renderer.turn_end_id == tok.convert_tokens_to_ids("<|im_end|>")
    cont = renderer.continuation_ids(convo, new)
    assert tok.decode(cont) == "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"


def test_no_chat_template_is_refused():
    tok = tiny_tokenizer("chatml")
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatRenderer(tok)


# ---------------------------------------------------------------- guess_digit

@pytest.fixture(scope="module")
def digit_tokenizer(tmp_path_factory):
    from rlflow.data.tasks import get_task

    return get_task("guess_digit").build_tokenizer(str(tmp_path_factory.mktemp("gd-tok")))


def play(env, guesses):
    out = [env.reset()]
    for g in guesses:
        step = env.step(g)
        out.append(step)
        if step.done:
            break
    return out


def test_guess_digit_replies_and_rewards():
    make = get_environment("guess_digit")
    assert "guess_digit" in registered_environments()
    env = make({"prompt": "?", "answer": "6"})
    steps = play(env, ["5", "8", " 6"])
    assert steps[0] == [{"role": "user", "content": "?"}]
    assert [s.messages for s in steps[1:3]] == [[{"role": "user", "content": "+"}],
                                                [{"role": "user", "content": "-"}]]
    assert steps[3].done and steps[3].reward == pytest.approx(1.0 - 0.1 * 2)
    assert steps[3].info == {"found": 1.0, "invalid": 0.0}
    # not found within max_turns: reward 0; a non-digit is an invalid turn
    env = make({"answer": "0"}, max_turns=2)
    steps = play(env, ["x", "9"])
    assert steps[1].messages == [{"role": "user", "content": "?"}] and not steps[1].done
    assert steps[1].info == {"invalid": 1.0}
    assert steps[2].done and steps[2].reward == 0.0 and steps[2].info == {"invalid": 0.0}
    # found at the first turn: 1.0; reset starts over
    assert play(env, ["0"])[1].reward == 1.0


def test_guess_digit_bad_record_and_options():
    make = get_environment("guess_digit")
    with pytest.raises(EnvError, match="'answer' must be one digit"):
        make({"answer": "12"})
    with pytest.raises(EnvError, match="max_turns"):
        make({"answer": "1"}, max_turns=0)
    with pytest.raises(EnvError, match="turn_penalty"):
        make({"answer": "1"}, max_turns=5, turn_penalty=0.25)


def test_guess_digit_episode_renders_in_the_demo_tokenizer(digit_tokenizer):
    from rlflow.data.tasks import get_task

    tok = digit_tokenizer
    assert len(tok) == 20
    renderer = ChatRenderer(tok)
    assert renderer.turn_end_id == tok.eos_token_id and renderer.scaffold == ""
    source = get_task("guess_digit").make_source(0)
    assert {source[i]["answer"] for i in range(100)} == set("01234")
    record = source[3]
    env = get_environment("guess_digit")(record)
    first = env.reset()
    turns, hidden = [], int(record["answer"])
    for g in ([hidden - 1, hidden] if hidden > 0 else [hidden + 1, hidden]):
        step = env.step(str(g))
        turns.append((str(g), step.messages or None))
    assert step.done and step.reward == pytest.approx(0.9)
    ids, mask, messages = simulate(renderer, tok, first, turns)
    assert tok.unk_token_id not in ids
    assert mask == oracle_mask(renderer, tok, ids, messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    # <bos><|user|>?<eos><|assistant|> d<eos> <|user|>±<eos><|assistant|> d<eos>
    assert len(ids) == 5 + 2 + 4 + 2 and sum(mask) == 4


def test_docs_example_environment_runs():
    import os
    import re

    from rlflow.envs import base

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "environments.md")
    with open(path) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.DOTALL).group(1)
    assert 25 <= len(code.strip().splitlines()) <= 35
    try:
        exec(compile(code, "docs/environments.md", "exec"), {"__name__": "my_envs"})
        env = get_environment("countdown")({"start": "2"})
        assert env.reset() == [{"role": "user", "content": "Count down from 2."}]
        assert env.step("1").messages == [{"role": "user", "content": "next"}]
        last = env.step("0")
        assert last.done and last.reward == 1.0
        with pytest.raises(EnvError, match="'start'"):
            get_environment("countdown")({"start": "x"})
    finally:
        base._REGISTRY.pop("countdown", None)


def test_environment_messages_are_checked(chat):
    _, _, renderer = chat
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "12"}]
    with pytest.raises(EnvError, match="message 0 field 'content' must be a str"):
        renderer.continuation_ids(convo, [{"role": "user", "content": 3}])
    with pytest.raises(EnvError, match="expected a list of messages"):
        renderer.prompt_ids("hi")
    raw = b"result: \xff\xfe".decode("utf-8", errors="surrogateescape")   # not valid text
    with pytest.raises(EnvError, match=r"message 1 field 'content' is not valid Unicode text "
                                       r"\(surrogates not allowed at character 8: 'result: "):
        renderer.continuation_ids(convo, [{"role": "user", "content": "ok"},
                                          {"role": "tool", "content": raw}])


def test_env_options_convert_by_the_factorys_annotations():
    """``env.options`` strings become the factory's typed keyword arguments; ``"False"`` is
    False (not a truthy string), an unknown key or a bad value is refused naming it, both
    when the sampler binds them and when ``rlflow train`` resolves the config."""
    from rlflow.config import ConfigError, EnvConfig, ExperimentConfig, replace
    from rlflow.console.checks import check_runnable
    from rlflow.envs.base import bind_options

    calc = get_environment("gsm8k_calculator")
    got = bind_options(calc, {"tools_in_template": "False", "max_tool_calls": "3",
                              "timeout_s": "2.5", "question_field": "None"})
    assert got == {"tools_in_template": False, "max_tool_calls": 3, "timeout_s": 2.5,
                   "question_field": None}
    assert bind_options(calc, {"tools_in_template": "on"})["tools_in_template"] is True
    with pytest.raises(EnvError, match=r"env.options: max_tool_calls: expected int, got 'x'"):
        bind_options(calc, {"max_tool_calls": "x"})
    with pytest.raises(EnvError, match=r"'max_turn' is not an option.*max_turns"):
        bind_options(get_environment("guess_digit"), {"max_turn": "3"})
    with pytest.raises(EnvError, match=r"tools_in_template: expected bool, got 'maybe'"):
        bind_options(calc, {"tools_in_template": "maybe"})
    cfg = replace(ExperimentConfig(), env=EnvConfig(name="guess_digit", options=("max_turn=3",)))
    with pytest.raises(ConfigError, match=r"^env.options: 'max_turn' is not an option"):
        check_runnable(cfg)
