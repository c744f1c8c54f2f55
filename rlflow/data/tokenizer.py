"""Small Hugging Face tokenizers built locally (no download), for the demo and for tests.

Both builders use the ``tokenizers`` library for the model and wrap it as a
``transformers.PreTrainedTokenizerFast`` saved with ``save_pretrained``, so
``AutoTokenizer.from_pretrained(out_dir)`` loads it like any hub tokenizer, and rlflow's
HF export can copy the folder next to a model.

Token ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, then (when a chat template
is used) the role tokens ``<|system|>``, ``<|user|>``, ``<|assistant|>``, then the alphabet
(character tokenizer) or the learned BPE vocabulary. Encoding with
``add_special_tokens=True`` prepends ``<bos>``.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

#: A minimal chat template over the role tokens; each turn ends with the EOS token, so a
#: model trained on it stops its answer with ``<eos>``.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer(alphabet: str, out_dir: str, *, chat_template: Optional[str] = None):
    """Build a character-level tokenizer (one token per character of ``alphabet``).

    Args:
      alphabet: the characters; duplicates are ignored, order gives the ids. Characters
        outside it encode as ``<unk>``.
      out_dir: folder written with ``save_pretrained`` (created if missing).
      chat_template: Jinja chat template; when given, the role tokens are added to the
        vocabulary (``DEFAULT_CHAT_TEMPLATE`` uses them).

    Returns:
      The tokenizer loaded back with ``AutoTokenizer.from_pretrained(out_dir)``
      (a ``PreTrainedTokenizerFast``); ``len(tok)`` = specials + roles + alphabet.

    Raises:
      ValueError: empty ``alphabet``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise ValueError("build_char_tokenizer: alphabet must not be empty")
    specials = _specials(chat_template)
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return _wrap_and_save(tok, specials, out_dir, chat_template)


def build_bpe_tokenizer(texts: Iterable[str], out_dir: str, *, vocab_size: int = 512,
                        chat_template: Optional[str] = DEFAULT_CHAT_TEMPLATE):
    """Train a byte-level BPE tokenizer on ``texts`` (e.g. GSM8K questions) and save it.

    Args:
      texts: training texts (an iterable of str).
      out_dir: folder written with ``save_pretrained``.
      vocab_size: target vocabulary size, special tokens and the 256 byte symbols included
        (so >= 256 + 7); the trainer may stop below it on small corpora.
      chat_template: Jinja chat template (default :data:`DEFAULT_CHAT_TEMPLATE`; None: none).

    Returns:
      The tokenizer loaded back with ``AutoTokenizer.from_pretrained(out_dir)``.

    Raises:
      ValueError: ``vocab_size`` too small for the byte alphabet and special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = _specials(chat_template)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(f"build_bpe_tokenizer: vocab_size must be >= "
                         f"{len(alphabet) + len(specials)} (bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap_and_save(tok, specials, out_dir, chat_template)


# ``tokenizer_class`` values of a plain ``tokenizers``-backed tokenizer (transformers 5 names
# it ``TokenizersBackend``, 4.x ``PreTrainedTokenizerFast``), as rlflow's own saved ones are.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def char_bound(tokenizer, max_tokens: int) -> int:
    """Characters above which a text cannot fit in ``max_tokens`` tokens of ``tokenizer``.

    No token decodes to more characters than its vocabulary entry has (byte-level BPE: one
    character per byte; SentencePiece: ``▁`` for a space, ``<0x0A>`` for one byte), so ``n``
    tokens cover at most ``n * L`` characters, ``L`` the longest entry; twice that (and
    1024 more) leaves room for a normaliser that shortens text. Texts over it are counted as
    too long without being tokenized (the data pipeline's prompts, an environment's
    messages): a tokenizer needs hundreds of times a text's size in memory (a 50 MB line
    took a learner past 24 GB).
    """
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * max_tokens * max(longest, 1) + 1024


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)`` for a local folder, with a clear error.

    A folder whose ``tokenizer_config.json`` names a generic class
    (:data:`GENERIC_TOKENIZER_CLASSES`) and that holds ``tokenizer.json`` is loaded with
    ``PreTrainedTokenizerFast`` directly: the same class ``AutoTokenizer`` picks, without
    importing transformers' model configuration modules, which import torch when it is
    installed (6.3 s against 1.3 s for a fresh process on a 2-core host, paid by every
    program of a run). Any other folder goes through ``AutoTokenizer``.

    Raises:
      FileNotFoundError: ``path`` is not a folder holding tokenizer files.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer folder not found: {path!r}")
    names = set(os.listdir(path))
    if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}:
        raise FileNotFoundError(f"{path!r} holds no tokenizer files (tokenizer.json, "
                                f"tokenizer_config.json); found {sorted(names)}")
    if "tokenizer.json" in names and _tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenizer_class(path: str) -> Optional[str]:
    """``tokenizer_class`` of ``path/tokenizer_config.json`` (None: no file, unreadable, or
    no such field; ``AutoTokenizer`` then decides, and reports what is wrong)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            value = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _specials(chat_template: Optional[str]) -> list:
    return list(SPECIAL_TOKENS) + (list(ROLE_TOKENS) if chat_template is not None else [])


def _wrap_and_save(tok, specials, out_dir: str, chat_template: Optional[str]):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS,
                                   bos_token=BOS, unk_token=UNK,
                                   additional_special_tokens=specials[len(SPECIAL_TOKENS):])
    if chat_template is not None:
        fast.chat_template = chat_template
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return load_tokenizer(out_dir)
