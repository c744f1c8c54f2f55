"""The client of a served reward (``reward.http`` / ``reward.judge``): requests made on an
asyncio event loop in a thread of the calling process, so the caller never waits on a server.

:class:`HttpScorer` takes samples (:meth:`HttpScorer.submit` returns at once), cuts them
into requests of ``batch_size``, sends at most ``max_concurrency`` at a time with one
``httpx.AsyncClient`` (connections kept alive), and puts one result per sample on the
caller's queue: ``(slot, sample task id, "ok" | "error" | "timeout", reward or message)``,
the shape of the reward workers' results (:mod:`rlflow.data.reward_workers`). The
:class:`rlflow.data.rewarder.Rewarder` drains that queue with its workers' results, so the
sampler's decode loop is never held by a slow server: a request is bounded by ``timeout_s``
per try (``asyncio.wait_for``: connect to last byte) and ``max_retries`` tries after the
first, each after a backoff of ``uniform(0, min(max_backoff_s, backoff_s * 2**k))`` seconds
(exponential backoff with full jitter, Brooker 2015, "Exponential Backoff And Jitter",
AWS Architecture Blog). Retried: a timeout, a connection error (a server restarting), an HTTP
408/429/5xx status, a reply that is not JSON or holds no valid score
(:class:`rlflow.data.served_rewards.MalformedReply`); not retried: other 4xx statuses (the
request itself is wrong). A request that fails after its tries gives each of its samples
"timeout" (its last try timed out) or "error", with the reason; the Rewarder scores them 0,
marks them failed and counts them.

Counters (:attr:`HttpScorer.counts`, running totals): ``requests`` (tries sent),
``retries`` (tries after a first), ``timeouts`` (tries that timed out), ``errors`` (tries
that failed otherwise).
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import threading
from typing import Dict, List, Mapping, Optional, Sequence

import httpx

from rlflow.config.secrets import SecretError, clean_api_key, redact_text
from rlflow.config.served_reward import ServedRewardConfig, header_pairs
from rlflow.data.served_rewards import MalformedReply, parse_reply, request_body

#: HTTP statuses worth another try (the server may recover); other 4xx are final.
RETRY_STATUSES = frozenset({408, 429})
#: Characters of an error reply's body quoted in the failure reason (after redaction).
REPLY_HEAD_CHARS = 200
#: Seconds :meth:`HttpScorer.close` waits for the loop to cancel its requests and stop.
CLOSE_TIMEOUT_S = 5.0


class ServedRewardError(RuntimeError):
    """A served reward cannot be set up (its API key's environment variable is unset)."""


def request_headers(cfg: ServedRewardConfig,
                    env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``cfg.headers`` plus the API key (from ``$cfg.api_key_env``) as its header.

    The key is stripped of surrounding whitespace (a key file's trailing CR/LF) and checked
    (:func:`rlflow.config.secrets.clean_api_key`).

    Raises:
      ServedRewardError: ``api_key_env`` is set and that variable is unset or empty, or its
        key holds a space, control or non-ASCII character (names the field and the
        variable, never the key).
    """
    env = os.environ if env is None else env
    headers = dict(header_pairs(cfg.headers))
    if cfg.api_key_env:
        try:
            key = clean_api_key(env.get(cfg.api_key_env), f"{cfg.SECTION}.api_key_env: the "
                                f"environment variable {cfg.api_key_env}")
        except SecretError as e:
            raise ServedRewardError(str(e)) from None
        headers[cfg.api_key_header] = cfg.api_key_prefix + key
    return headers


def backoff_s(cfg: ServedRewardConfig, retry: int, rng: random.Random) -> float:
    """Seconds to wait before retry ``retry`` (1, 2, ...): full jitter over
    ``min(max_backoff_s, backoff_s * 2**(retry - 1))``."""
    return rng.uniform(0.0, min(cfg.max_backoff_s, cfg.backoff_s * 2.0 ** (retry - 1)))


class HttpScorer:
    """One served reward's requests, on its own event-loop thread (see the module docstring).

    Args:
      slot: this reward's index among the Rewarder's functions (tags every result).
      cfg: the reward's :class:`rlflow.config.HttpRewardConfig` or
        :class:`rlflow.config.JudgeConfig`.
      results: the queue its results go to (shared with other scorers).
      seed: the backoff jitter's seed.

    Raises:
      ServedRewardError: the API key's environment variable is unset (:func:`request_headers`).
    """

    def __init__(self, slot: int, cfg: ServedRewardConfig, results: "queue.SimpleQueue",
                 seed: Optional[int] = None):
        self.slot, self.cfg = slot, cfg
        self.counts = {"requests": 0, "retries": 0, "timeouts": 0, "errors": 0}
        self._results = results
        self._headers = request_headers(cfg)
        # the key: hidden in every reason this scorer reports (a server may echo the key in
        # its reply; httpx quotes the header in its errors). The header is the fixed prefix
        # and the key, so hiding the key hides it; the prefix itself is not secret, and as a
        # secret its start ("Bearer s") would make every cut-off "Bearer s..." redacted
        sent = self._headers[cfg.api_key_header] if cfg.api_key_env else ""
        self._secrets = [sent[len(cfg.api_key_prefix):]] if sent else []
        self._rng = random.Random(seed)
        self._next_id = 0
        self._tasks: set = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"rlflow-{cfg.SECTION}")
        self._thread.start()
        self._client, self._gate = asyncio.run_coroutine_threadsafe(
            self._open(), self._loop).result()

    async def _open(self):
        limits = httpx.Limits(max_connections=self.cfg.max_concurrency,
                              max_keepalive_connections=self.cfg.max_concurrency)
        client = httpx.AsyncClient(timeout=httpx.Timeout(self.cfg.timeout_s), limits=limits,
                                   headers=self._headers)
        return client, asyncio.Semaphore(self.cfg.max_concurrency)

    def submit(self, samples: Sequence[Mapping[str, str]]) -> List[int]:
        """Queue ``samples`` (dicts of :func:`rlflow.data.served_rewards.sample_dict`) in
        requests of ``batch_size``; returns one task id per sample, in order. Never waits."""
        ids = list(range(self._next_id, self._next_id + len(samples)))
        self._next_id += len(samples)
        size = self.cfg.batch_size
        for start in range(0, len(samples), size):
            self._loop.call_soon_threadsafe(self._start, ids[start:start + size],
                                            list(samples[start:start + size]))
        return ids

    def close(self) -> None:
        """Cancel the requests in flight (their samples get no result), close the client and
        stop the loop's thread."""
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(
                CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - closing: nothing left to report to
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    # ------------------------------------------------------------------ on the loop
    def _start(self, ids: List[int], samples: list) -> None:
        task = self._loop.create_task(self._score(ids, samples))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    async def _score(self, ids: List[int], samples: list) -> None:
        try:
            async with self._gate:
                status, value = await self._request(samples)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not leave samples unscored
            status, value = "error", f"{type(e).__name__}: {e}"
        if status != "ok":
            value = redact_text(value, self._secrets)
        for j, task_id in enumerate(ids):
            self._results.put((self.slot, task_id, status,
                               value[j] if status == "ok" else value))

    async def _request(self, samples: list):
        """``("ok", [reward per sample])`` or ``("timeout" | "error", reason)`` after the
        tries (module docstring)."""
        cfg = self.cfg
        body = request_body(cfg, samples)
        status, reason = "error", "no try made"
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self.counts["retries"] += 1
                await asyncio.sleep(backoff_s(cfg, attempt, self._rng))
            self.counts["requests"] += 1
            try:
                reply = await asyncio.wait_for(self._client.post(cfg.url, json=body),
                                               cfg.timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                self.counts["timeouts"] += 1
                status, reason = "timeout", f"no reply within {cfg.timeout_s} s"
                continue
            except httpx.HTTPError as e:        # refused, reset, a broken reply
                self.counts["errors"] += 1
                status, reason = "error", f"{type(e).__name__}: {e}"
                continue
            if not 200 <= reply.status_code < 300:
                self.counts["errors"] += 1
                # the body redacted first, then cut: a key crossing the cut stays hidden
                body_head = redact_text(reply.text, self._secrets)[:REPLY_HEAD_CHARS]
                status, reason = "error", f"HTTP {reply.status_code}: {body_head!r}"
                if 400 <= reply.status_code < 500 \
                        and reply.status_code not in RETRY_STATUSES:
                    break                       # the request itself is wrong: final
                continue
            try:
                return "ok", parse_reply(cfg, reply.text, len(samples), self._secrets)
            except MalformedReply as e:
                self.counts["errors"] += 1
                status, reason = "error", f"malformed reply: {e}"
        return status, f"{cfg.url}: {reason} (tries: {attempt + 1})"
