"""Token rendering of multi-turn episodes with the model's chat template (token in, token out).

An episode's token ids are its record. The sampler keeps the exact ids it sampled and, after
each environment step, appends only the ids of what the chat template renders *after* the
sampled turn; past turns are never re-tokenized. With ``A_t`` the rendering of the
conversation before assistant turn ``t`` with the generation prompt, ``s_t`` the sampled
assistant text and ``<eot>`` the template's end-of-turn token::

    episode ids = ids(A_1) + sampled_1 + continuation_1 + sampled_2 + continuation_2 + ...
    sampled_t   = the policy's ids of turn t, ending with <eot>           (loss mask 1)
    continuation_t = ids(scaffold after <eot> + new messages + generation prompt)  (mask 0)

``prompt_ids`` gives ``ids(A_1)``; ``continuation_ids`` gives ``continuation_t``: the text of
``A_{t+1}`` after the end-of-turn token that closes assistant turn ``t``. It checks, as text,
that the template's rendering of the longer conversation extends the shorter one (``A_t`` is a
prefix of ``A_{t+1}``); a template that rewrites earlier turns (e.g. one that drops past
reasoning once a new user turn comes, or whose generation prompt differs from the assistant
header it renders in history) raises :class:`ChatTemplateError`. Since ``A_{t+1}`` is rendered
from the same messages as the next call's ``A_t``, the checks chain over the whole episode.
A template that decorates only the *last* assistant message (Qwen3's empty think block) is
fine: the last-message rendering is never used. The assistant header comes only from the
generation prompt, so it is never rendered twice.

Final-text semantics: when every assistant message's content is rendered verbatim (the
template does not trim or rewrite it), the episode ids decode (special tokens kept) to
``apply_chat_template(final conversation, add_generation_prompt=False, tokenize=False)``
minus the template's scaffolding after the last end-of-turn token (ChatML's ``"\\n"``;
Llama-3 has none): the episode ends on the sampled ``<eot>``. A template that trims content
(Llama-3's ``| trim``) renders ``" 5"`` as ``"5"``; the episode keeps the policy's ``" 5"``
(the sampled ids are the truth, the rendering of the assistant content is never used).

Token boundaries: each continuation is tokenized on its own (``add_special_tokens=False``),
so the episode ids may differ from tokenizing the whole rendering at the seams (a BPE merge
across the end of a sampled turn cannot happen, since ``<eot>`` is a special token; across
the start of a continuation it could only if the scaffold began with mergeable text).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from rlflow.envs.base import EnvError, Message

#: Content of the probe assistant message used to find the end-of-turn token.
_PROBE = "rlflow-probe-7319"


class ChatTemplateError(ValueError):
    """The chat template cannot render a conversation incrementally: a longer conversation's
    rendering does not extend the shorter one's, or the end-of-turn token cannot be found."""


def check_messages(messages, where: str) -> List[Message]:
    """``messages`` as a list of ``{"role": str, "content": str, ...}`` dicts.

    Args:
      messages: what an environment returned.
      where: names the caller in the error (e.g. ``"guess_digit.step"``).

    Raises:
      EnvError: not a list of dicts with string ``role`` and ``content``, or a string that
        is not valid Unicode (lone surrogates); the message names the index and what was
        found.
    """
    if not isinstance(messages, (list, tuple)):
        raise EnvError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise EnvError(f"{where}: message {i} is a {type(m).__name__}, expected a dict "
                           f"with 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise EnvError(f"{where}: message {i} field {key!r} must be a str, got "
                               f"{type(m.get(key)).__name__}")
            try:
                m[key].encode("utf-8")
            except UnicodeEncodeError as e:     # e.g. bytes decoded with surrogateescape
                raise EnvError(f"{where}: message {i} field {key!r} is not valid Unicode "
                               f"text ({e.reason} at character {e.start}: "
                               f"{m[key][max(0, e.start - 20):e.start + 1]!r}); decode "
                               f"bytes with errors='replace'") from None
    return list(messages)


def episode_mask(segments: Sequence[Tuple[Sequence[int], bool]]) -> Tuple[List[int], List[int]]:
    """Concatenate an episode's segments into ids and loss mask.

    Args:
      segments: ``(ids, sampled)`` in episode order: the prompt ids (``False``), each turn's
        sampled ids (``True``), each continuation (``False``).

    Returns:
      ``(ids, mask)``: two lists of equal length; ``mask[i]`` is 1 for ids of sampled
      segments, 0 otherwise.
    """
    ids: List[int] = []
    mask: List[int] = []
    for seg, sampled in segments:
        seg = [int(t) for t in seg]
        ids.extend(seg)
        mask.extend([int(bool(sampled))] * len(seg))
    return ids, mask


class ChatRenderer:
    """Renders an episode's turns into token ids with a tokenizer's chat template.

    Args:
      tokenizer: a ``transformers`` tokenizer with ``chat_template`` set (e.g. a
        ``PreTrainedTokenizerFast`` loaded from a model folder).
      strict: raise :class:`ChatTemplateError` when the template renders a sampled
        assistant message's content differently (trimmed, dropped); default: count it in
        ``content_mismatches`` and go on (the episode keeps the sampled ids).

    Attributes:
      turn_end_id: the template's end-of-turn token id (``<|im_end|>``, ``<|eot_id|>``, the
        demo's ``<eos>``): a sampled turn that ends with it can be continued.
      end_of_turn_ids: ids a turn stops on: ``turn_end_id`` and the tokenizer's EOS (when
        different). A turn that ends on EOS but not on ``turn_end_id`` ends the episode.
      scaffold: the text the template renders after an assistant message's end-of-turn
        token (ChatML ``"\\n"``, Llama-3 ``""``).
      content_mismatches: continuations whose template rendering of the sampled content
        differed from it (``strict=False``); the episode text then differs from the
        template's rendering of the final conversation there.

    Raises:
      ChatTemplateError: no chat template, or the template's rendering of an assistant
        message does not end with a single special token (the end of turn).
    """

    def __init__(self, tokenizer, *, strict: bool = False):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat_template; multi-turn episodes "
                                    "need one (set tokenizer.chat_template)")
        self.tokenizer = tokenizer
        self.strict = bool(strict)
        self.content_mismatches = 0
        self.turn_end_id, self.scaffold = self._probe_end_of_turn()
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = [self.turn_end_id] + ([int(eos)] if eos is not None else [])
        self.end_of_turn_ids: Tuple[int, ...] = tuple(dict.fromkeys(ids))

    # ------------------------------------------------------------------ rendering
    def render(self, messages: Sequence[Message], *, tools=None,
               add_generation_prompt: bool) -> str:
        """``tokenizer.apply_chat_template(messages, tools=..., tokenize=False)`` as a str."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
            tokenize=False)
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template returned {type(text).__name__}, "
                                    f"expected str")
        return text

    def encode(self, text: str) -> List[int]:
        """Ids of ``text`` without added special tokens (the template renders BOS itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def assistant_text(self, sampled_ids: Sequence[int]) -> str:
        """The assistant message's content for ``Environment.step`` and the conversation:
        ``sampled_ids`` without its trailing ids of :attr:`end_of_turn_ids`, decoded with
        special tokens kept (so that the template renders exactly the sampled text)."""
        ids = [int(t) for t in sampled_ids]
        while ids and ids[-1] in self.end_of_turn_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Message], tools=None) -> List[int]:
        """Ids of the episode's first prompt: ``messages`` rendered with the generation
        prompt (``ids(A_1)`` in the module docstring). ``tools``: JSON-schema tool list
        passed to the template (Qwen's ``tools=``), or None.

        Raises:
          EnvError: ``messages`` is not a list of ``{"role": str, "content": str}`` dicts.
        """
        check_messages(messages, "reset() messages")
        return self.encode(self.render(messages, tools=tools, add_generation_prompt=True))

    def continuation_ids(self, messages: Sequence[Message], new_messages: Sequence[Message],
                         tools=None) -> List[int]:
        """Ids to append after a sampled turn: scaffolding after its end-of-turn token, the
        environment's ``new_messages`` and the next generation prompt.

        Args:
          messages: the conversation so far; its last entry is the assistant message whose
            sampled ids ended with :attr:`turn_end_id` (content: the decoded text without it).
          new_messages: the environment's messages (tool results, a user turn), non-empty.
          tools: as in :meth:`prompt_ids` (must be the same for the whole episode).

        Returns:
          The ids (loss mask 0), tokenized on their own: past turns are not re-tokenized.

        Raises:
          ChatTemplateError: the last message is not an assistant message, no new message,
            or a longer conversation's rendering does not extend the shorter one's.
          EnvError: ``new_messages`` is not a list of ``{"role": str, "content": str}``.
        """
        check_messages(new_messages, "step() messages")
        if not messages or messages[-1].get("role") != "assistant":
            raise ChatTemplateError("continuation_ids: the conversation must end with the "
                                    "assistant message just sampled")
        if not new_messages:
            raise ChatTemplateError("continuation_ids: no new messages to render")
        before = self.render(messages[:-1], tools=tools, add_generation_prompt=True)
        after = self.render(list(messages) + list(new_messages), tools=tools,
                            add_generation_prompt=True)
        _check_extends(before, after, "the conversation before the assistant turn",
                       "the conversation with the assistant turn and the new messages")
        rest = after[len(before):]
        eot = self.tokenizer.convert_ids_to_tokens(self.turn_end_id)
        content = messages[-1].get("content") or ""
        if rest.startswith(content + eot):
            end = len(content)            # the assistant content as sampled (the usual case)
        else:                             # the template changed it (e.g. Llama-3's trim)
            if self.strict:
                raise ChatTemplateError(f"the template renders the sampled assistant content "
                                        f"{content[:60]!r} differently: {rest[:80]!r}")
            self.content_mismatches += 1
            end = rest.find(eot)
        if end < 0:
            raise ChatTemplateError(f"the template's rendering of the assistant turn has no "
                                    f"end-of-turn token {eot!r}: {rest[:80]!r}")
        return self.encode(rest[end + len(eot):])

    # ------------------------------------------------------------------ internals
    def _probe_end_of_turn(self) -> Tuple[int, str]:
        user = [{"role": "user", "content": "hi"}]
        before = self.render(user, add_generation_prompt=True)
        through = self.render(user + [{"role": "assistant", "content": _PROBE}],
                              add_generation_prompt=False)
        _check_extends(before, through, "a user turn with the generation prompt",
                       "the same turn followed by an assistant message")
        turn = through[len(before):]
        at = turn.find(_PROBE)
        if at < 0:
            raise ChatTemplateError(f"the template does not render assistant content as is: "
                                    f"{turn!r}")
        tail = turn[at + len(_PROBE):]
        ids = self.encode(tail)
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        added = {int(i) for i in getattr(self.tokenizer, "added_tokens_decoder", {})}
        if not ids or (ids[0] not in special and ids[0] not in added):
            raise ChatTemplateError(f"the template's assistant message does not end with a "
                                    f"special end-of-turn token: it ends with {tail!r}")
        eot_text = self.tokenizer.convert_ids_to_tokens(ids[0])
        if not tail.startswith(eot_text):
            raise ChatTemplateError(f"end-of-turn token {eot_text!r} is not the text right "
                                    f"after the assistant content ({tail!r})")
        return int(ids[0]), tail[len(eot_text):]


def _check_extends(shorter: str, longer: str, short_name: str, long_name: str) -> None:
    if not longer.startswith(shorter):
        at = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b),
                  min(len(shorter), len(longer)))
        raise ChatTemplateError(
            f"the chat template's rendering of {long_name} does not extend its rendering of "
            f"{short_name} (first difference at character {at}: {shorter[at:at + 40]!r} vs "
            f"{longer[at:at + 40]!r}); such a template rewrites earlier turns and cannot be "
            f"continued token by token")
