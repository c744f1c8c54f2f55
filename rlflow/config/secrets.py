"""Secrets of a run (the ring-buffer token, the served rewards' API keys): where they come
from and how every writer hides them.

One list, :data:`SECRET_FIELDS`, names the config fields that hold secrets (dotted paths of
``ExperimentConfig``). Everything that writes a config or text a user may share goes
through this module:

* :func:`redact_config` replaces each non-empty secret field of a config dict with
  :data:`REDACTED` (``config.json``, the TensorBoard config text, checkpoint metadata).
* :func:`install_log_redaction` makes every ``logging`` handler replace each secret found in
  what it writes (message, traceback) with :data:`REDACTED` (the programs' logs), and
  :func:`install_stream_redaction` does the same for ``sys.stdout`` / ``sys.stderr`` (a fatal
  traceback, ``print``); a program installs both.
* :func:`redact_text` does the same for any other text (reports, error messages).

Each secret is redacted in every form it takes in text (:func:`secret_forms`): with and
without surrounding whitespace, and as ``repr`` of str and bytes and JSON escape it (an
httpx ``Illegal header value b'Bearer sk-...\\r'``), once or twice; a cut-off start of
:data:`MIN_PREFIX` or more characters is redacted too. An API key holding a quote or a
backslash is refused where it is read (:func:`clean_api_key`).

Where the token comes from (:func:`resolve_secrets`, first match wins):

1. ``buffer.token`` set in the config file (not on the command line: ``rlflow train``
   refuses ``--buffer.token``, since every user of the host sees a process's argv in ``ps``);
2. the environment variable ``RLFLOW_BUFFER_TOKEN`` (:data:`ENV_BUFFER_TOKEN`);
3. ``buffer.token_file``: a file that only its owner may read (mode ``0600`` or stricter;
   any other mode is refused, naming the file and its mode). Its content, stripped of
   surrounding whitespace, is the token.

The launcher hands the token to its two programs in their environment (never argv); the
programs' ``config.json`` holds :data:`REDACTED` and :func:`resolve_secrets` puts the value
back from the environment.

A served reward's API key (``reward.http`` / ``reward.judge``) is never in a config: the
config names the environment variable that holds it (``api_key_env``,
:data:`SECRET_ENV_FIELDS`), the programs inherit it, the sampler reads it where it makes the
requests (:mod:`rlflow.data.http_scorer`; stripped and checked by :func:`clean_api_key`),
and :func:`secret_values` gives its value to the log redaction.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import os
import stat
import sys
from typing import Any, Iterable, Mapping, Optional

ENV_BUFFER_TOKEN = "RLFLOW_BUFFER_TOKEN"
REDACTED = "<redacted>"
# Dotted paths of the ExperimentConfig fields that hold secrets.
SECRET_FIELDS: tuple[str, ...] = ("buffer.token",)
# Dotted paths of the fields that name an environment variable holding a secret.
SECRET_ENV_FIELDS: tuple[str, ...] = ("reward.http.api_key_env", "reward.judge.api_key_env")
# Characters of printable ASCII that repr / JSON quoting escape (refused in an API key).
NEEDS_ESCAPE = frozenset("\"'\\")
# Command-line flags that would put a secret in argv (refused by `rlflow train`).
SECRET_FLAGS: tuple[str, ...] = tuple("--" + f for f in SECRET_FIELDS)


class SecretError(ValueError):
    """A secret is missing, passed in a visible place, or its file is readable by others."""


def _get(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def redact_config(data: Mapping[str, Any]) -> dict:
    """A deep copy of a config dict (``dataclasses.asdict`` of ``ExperimentConfig``) with
    every non-empty :data:`SECRET_FIELDS` value replaced by :data:`REDACTED`."""
    out = copy.deepcopy(dict(data))
    for path in SECRET_FIELDS:
        *parents, last = path.split(".")
        node = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict) and node.get(last):
            node[last] = REDACTED
    return out


def secret_values(cfg_or_dict: Any, env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The non-empty, non-redacted secret values of a config (dataclass or dict), and the
    values of the environment variables (``env``, default ``os.environ``) its
    :data:`SECRET_ENV_FIELDS` name."""
    env = os.environ if env is None else env
    data = dataclasses.asdict(cfg_or_dict) if dataclasses.is_dataclass(cfg_or_dict) \
        else cfg_or_dict
    values = [_get(data, p) for p in SECRET_FIELDS]
    values += [env.get(name) for name in (_get(data, p) for p in SECRET_ENV_FIELDS)
               if isinstance(name, str) and name]
    return [v for v in values if isinstance(v, str) and v and v != REDACTED]


#: the shortest cut-off start of a secret form that :func:`redact_text` hides (a quoted reply
#: cut at a fixed length can end inside the key)
MIN_PREFIX = 8


def _escapes(value: str) -> set[str]:
    """``value`` as is and as each quoting escapes it: Python's ``repr`` of the str and of
    its bytes (alone, and inside a longer text holding both quote kinds, where ``'`` becomes
    ``\\'``), and JSON (ASCII-escaped and not)."""
    raw = value.encode("utf-8", "backslashreplace")
    return {value, repr(value)[1:-1], repr(value + "'\"")[1:-4],
            repr(raw)[2:-1], repr(raw + b"'\"")[2:-4],
            json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}


@functools.lru_cache(maxsize=64)
def _forms(secret: str) -> tuple[str, ...]:
    out: set[str] = set()
    for value in {secret, secret.strip()}:
        if not value.strip():
            continue
        for once in _escapes(value):       # and escaped twice: the repr of a JSON-escaped
            out.update(_escapes(once))     # key in a quoted reply, JSON of a repr
    return tuple(sorted(out, key=len, reverse=True))


def secret_forms(secret: str) -> list[str]:
    """Every spelling in which ``secret`` can reach a log or a terminal, longest first: the
    value and the value stripped of surrounding whitespace (an editor's trailing CR/LF), each
    as is, as Python's ``repr`` of the str and of its bytes writes it (``b'Bearer sk-..\\r'``
    in an httpx error; also inside a text holding both quote kinds), and as JSON escapes it
    (ASCII-escaped or not), and each of these escaped once more (the ``repr`` of a reply
    quoting the JSON-escaped key: ``sk-a\\\\\\\\b``). Empty for an empty or all-space value."""
    return list(_forms(secret))


def _cut_prefixes(text: str, form: str) -> str:
    """``text`` with every run of :data:`MIN_PREFIX` or more characters that starts ``form``
    (but is shorter than it: a key cut off by a length limit) replaced by :data:`REDACTED`."""
    if len(form) <= MIN_PREFIX:
        return text
    head, out, i = form[:MIN_PREFIX], [], 0
    while (j := text.find(head, i)) >= 0:
        k = MIN_PREFIX
        while k < len(form) and j + k < len(text) and text[j + k] == form[k]:
            k += 1
        out.append(text[i:j] + REDACTED)
        i = j + k
    return "".join(out) + text[i:] if out else text


@functools.lru_cache(maxsize=16)
def _all_forms(secrets: tuple[str, ...]) -> tuple[str, ...]:
    """The forms of all ``secrets`` together, longest first (built once per set of secrets:
    :func:`redact_text` runs on every log line and every write to stdout / stderr)."""
    return tuple(sorted({f for s in secrets for f in _forms(s)}, key=len, reverse=True))


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each secret, in each of its
    :func:`secret_forms`, replaced by :data:`REDACTED`; then every run of
    :data:`MIN_PREFIX` or more characters that starts a form (a secret cut off where a
    quoted text was shortened) too. Quote a server's text redacted first, then cut it: a
    cut-off key shorter than :data:`MIN_PREFIX` is not recognizable here."""
    forms = _all_forms(tuple(s for s in secrets if s))
    for f in forms:
        text = text.replace(f, REDACTED)
    for f in forms:
        text = _cut_prefixes(text, f)
    return text


# the secrets given to install_log_redaction in this process (redact_installed)
_INSTALLED: list[str] = []


def redact_installed(text: str) -> str:
    """``text`` redacted of every secret :func:`install_log_redaction` was given in this
    process (for text written outside ``logging``: a fatal traceback, a failure line)."""
    return redact_text(text, _INSTALLED)


class _RedactingFormatter(logging.Formatter):
    """A handler's formatter whose whole output (message, arguments, traceback, stack) is
    redacted: a secret in an exception logged with ``exc_info`` is hidden too."""

    def __init__(self, inner: Optional[logging.Formatter], secrets: list[str]):
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(self.inner.format(record), self.secrets)


class _RedactingStream:
    """A text stream (``sys.stdout`` / ``sys.stderr``) whose writes are redacted; every
    other attribute is the wrapped stream's."""

    def __init__(self, stream, secrets: list[str]):
        self._stream, self._secrets = stream, secrets

    def write(self, text):
        return self._stream.write(redact_text(text, self._secrets))

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def install_log_redaction(secrets: Iterable[str],
                          logger: Optional[logging.Logger] = None) -> None:
    """Redact ``secrets`` (each in every one of its :func:`secret_forms`) in everything the
    handlers of ``logger`` (default: the root logger, i.e. every ``rlflow`` log line; call
    after ``logging.basicConfig``) write, tracebacks included, and remember them for
    :func:`redact_installed`."""
    secrets = [s for s in secrets if s]
    _INSTALLED.extend(s for s in secrets if s not in _INSTALLED)
    logger = logger or logging.getLogger()
    for handler in logger.handlers:
        if not isinstance(handler.formatter, _RedactingFormatter):
            handler.setFormatter(_RedactingFormatter(handler.formatter, secrets))
        else:
            handler.formatter.secrets = sorted(set(handler.formatter.secrets) | set(secrets))


def install_stream_redaction(secrets: Iterable[str]) -> None:
    """Redact ``secrets`` in everything this process writes through ``sys.stdout`` and
    ``sys.stderr`` (``print``, ``traceback.print_exc``, the default ``sys.excepthook`` and
    ``threading.excepthook``, ``warnings``); for a program whose output is its log file."""
    secrets = [s for s in secrets if s]
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _RedactingStream):
            stream._secrets = sorted(set(stream._secrets) | set(secrets))
        elif stream is not None:
            setattr(sys, name, _RedactingStream(stream, secrets))


def clean_api_key(value: Optional[str], where: str) -> str:
    """An API key as read from its source (an environment variable filled from a file),
    stripped of surrounding whitespace (an editor's trailing CR/LF) and checked.

    Args:
      value: the raw value (None: unset).
      where: the source for messages, e.g. ``"reward.http.api_key_env: the environment
        variable MY_KEY"``.

    Returns: the key, printable ASCII without spaces, quotes or backslashes.

    Raises: SecretError naming ``where`` (never the key): unset or blank, or holding a
      space, a control character or a non-ASCII character inside (an HTTP header value
      cannot carry them, and such a key is a pasting mistake), or a quote (``"``, ``'``) or
      backslash (:data:`NEEDS_ESCAPE`: no API key holds them, RFC 7235 token68 has none, and
      every quoting of a text escapes them, so a log could show the key in a spelling
      that is not the key's).
    """
    key = (value or "").strip()
    if not key:
        raise SecretError(f"{where} holds no API key")
    for i, ch in enumerate(key):
        if not "!" <= ch <= "~" or ch in NEEDS_ESCAPE:
            what = ("a space" if ch == " " else
                    f"a control character (U+{ord(ch):04X})" if ord(ch) < 32 or ord(ch) == 127
                    else "a quote or backslash" if ch in NEEDS_ESCAPE
                    else "a non-ASCII character")            # never the character itself
            raise SecretError(
                f"{where} holds an API key with {what} at character {i + 1} of {len(key)} "
                f"(expected printable ASCII without spaces, quotes or backslashes: an API key "
                f"is a token such as RFC 7235's token68; whitespace around the key, such as a "
                f"trailing CR/LF, is removed)")
    return key


def read_token_file(path: str) -> str:
    """The token in ``path`` (whitespace-stripped).

    Raises:
      SecretError: the file is missing, empty, or readable/writable by group or others
        (the message names the file and its mode, and the fix ``chmod 600``).
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise SecretError(f"buffer.token_file: cannot read {path} ({e.strerror})") from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SecretError(f"buffer.token_file: {path} has mode {mode:04o}; a secret file must "
                          f"be readable by its owner only (chmod 600 {path})")
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise SecretError(f"buffer.token_file: {path} is empty")
    return token


def token_source_given(token: str, token_file: str, env: Optional[Mapping[str, str]] = None
                       ) -> bool:
    """Whether some source of the buffer token is set (config value, file or environment);
    used by config validation, which must not read the file itself."""
    env = os.environ if env is None else env
    return bool(token) or bool(token_file) or bool(env.get(ENV_BUFFER_TOKEN))


def resolve_buffer_token(token: str, token_file: str,
                         env: Optional[Mapping[str, str]] = None) -> str:
    """The buffer token from the config value, ``RLFLOW_BUFFER_TOKEN`` or the token file
    (in that order; a :data:`REDACTED` config value counts as unset). "" when none is set.

    Raises:
      SecretError: the config holds :data:`REDACTED` and no other source is set (a
        ``config.json`` copied from a run folder), or the token file is refused.
    """
    env = os.environ if env is None else env
    if token and token != REDACTED:
        return token
    if env.get(ENV_BUFFER_TOKEN):
        return env[ENV_BUFFER_TOKEN]
    if token_file:
        return read_token_file(token_file)
    if token == REDACTED:
        raise SecretError(f"buffer.token: the config holds {REDACTED} (a config.json from a "
                          f"run folder); set {ENV_BUFFER_TOKEN} or buffer.token_file")
    return ""


def resolve_secrets(cfg, env: Optional[Mapping[str, str]] = None):
    """``cfg`` (an ``ExperimentConfig``) with ``buffer.token`` set from its source (see the
    module docstring). Raises :class:`SecretError` as :func:`resolve_buffer_token`."""
    b = cfg.buffer
    token = resolve_buffer_token(b.token, b.token_file, env)
    if token == b.token:
        return cfg
    return dataclasses.replace(cfg, buffer=dataclasses.replace(b, token=token))


def refuse_secret_flags(argv: Iterable[str]) -> None:
    """Raise :class:`SecretError` when ``argv`` passes a secret (``--buffer.token X`` or
    ``--buffer.token=X``): any user of the host can read a process's argv."""
    for word in argv:
        for flag in SECRET_FLAGS + tuple(f.replace("_", "-") for f in SECRET_FLAGS):
            if word == flag or word.startswith(flag + "="):
                raise SecretError(
                    f"{flag} on the command line is visible to every user of this host (ps); "
                    f"set {ENV_BUFFER_TOKEN} in the environment or pass --buffer.token_file "
                    "PATH (a file with mode 0600)")
