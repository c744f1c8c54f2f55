"""The journal of partial generations: a sampler replica's in-flight samples, in its run folder.

Each replica writes ``<run folder>/journal/<replica>.npz`` whole, atomically
(:func:`rlflow.run.files.write_atomic`: a reader sees the previous journal or the new one,
never part; local or ``gs://``), every ``sampler.journal_every_steps`` decode calls. It
holds one :class:`JournalEntry` per sample of every group the replica has in flight: the
prompt's lease keys (``stream_index``, ``seed``: the ledger re-dispatches an unfinished
prompt with the same ones), the sample's index in its group, its tokens so far with their
behaviour logprobs and the policy version each was sampled with, and its finish reason when
it already finished (its group waits for the others). A multi-turn episode's entry holds the
episode so far the same way: its sampled turns (logprobs, versions >= 0) and the
environment's tokens between them (logprob 0, version -1: the loss mask is ``versions >=
0``), and, once finished, the environment's reward and whether an environment failure cut it
(``reward``, ``failed``); the environment's own state is not stored but rebuilt from the
turns (:meth:`rlflow.sampler.episodes.EpisodeDriver.resume`). A restarted replica reads every
journal (:func:`read_journals`) and resumes a re-leased prompt's samples from them
(``rlflow.sampler.program``), so a kill -9 loses only the tokens decoded since the last
write.

Format (no pickle): an ``.npz`` (``numpy.savez``) with ``header``, the UTF-8 JSON
``{"format": 1, "replica": str, "launch": str, "entries": [{"stream_index", "seed", "prompt_id",
"sample_index", "finish_reason", "n", "crc"[, "reward", "failed"]}, ...]}`` as ``uint8``
(``reward``, a float, and ``failed``, a bool: finished episodes only), and per entry ``i`` the
arrays ``t<i>`` (int32 ``[n]`` token ids), ``l<i>`` (float32 ``[n]`` logprobs, nats) and
``v<i>`` (int32 ``[n]`` policy versions). ``crc`` is the CRC-32 (:func:`zlib.crc32`) of the
three arrays' bytes in that order. A file that cannot be read counts as one damaged entry;
an entry whose arrays are missing, misshapen or fail their CRC is skipped and counted
(``damaged``); neither raises.
"""

from __future__ import annotations

import io
import json
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from rlflow.run import files

FORMAT = 1
FOLDER = "journal"


@dataclass(frozen=True)
class JournalEntry:
    """One sample's generation so far.

    Attributes:
      stream_index, seed: the prompt's lease keys (position in the prompt stream and the
        seed the ledger derived from it).
      prompt_id: the prompt's id (for messages).
      sample_index: the sample's index in its group, ``0 .. G - 1``.
      tokens: int32 ``[n]`` completion token ids so far.
      logprobs: float32 ``[n]`` behaviour logprobs (nats) of those tokens.
      versions: int32 ``[n]`` the policy version each token was sampled with.
      finish_reason: "stop" / "length" when the sample finished, "" while it decodes.
      launch: the launch of the run that wrote it (the learner's run control names each
        start of a run, :class:`rlflow.control.run_control.RunCoordinator`; its file's
        header): a resumed run republishes version numbers past its checkpoint with other
        weights, so tokens of those versions count only within their launch.
      reward: a finished multi-turn episode's reward from its environment (None otherwise).
      failed: a finished episode was cut by an environment error or timeout.

    A multi-turn episode's environment tokens have logprob 0 and version -1.
    """

    stream_index: int
    seed: int
    prompt_id: int
    sample_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str = ""
    launch: str = ""
    reward: Optional[float] = None
    failed: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (int(self.stream_index), int(self.seed))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.ascontiguousarray(self.tokens, np.int32),
                np.ascontiguousarray(self.logprobs, np.float32),
                np.ascontiguousarray(self.versions, np.int32))


def _crc(arrays) -> int:
    crc = 0
    for a in arrays:
        crc = zlib.crc32(a.tobytes(), crc)
    return crc


def encode(replica: str, entries: Sequence[JournalEntry], launch: str = "") -> bytes:
    """The journal file's bytes (module docstring).

    Raises:
      ValueError: an entry's three arrays differ in length.
    """
    arrays, meta = {}, []
    for i, e in enumerate(entries):
        t, lp, v = e.arrays()
        if not t.shape == lp.shape == v.shape or t.ndim != 1:
            raise ValueError(f"journal entry prompt_id {e.prompt_id} sample {e.sample_index}: "
                             f"tokens {t.shape}, logprobs {lp.shape} and versions {v.shape} "
                             f"must be the same 1-D length")
        arrays.update({f"t{i}": t, f"l{i}": lp, f"v{i}": v})
        m = {"stream_index": int(e.stream_index), "seed": int(e.seed),
             "prompt_id": int(e.prompt_id), "sample_index": int(e.sample_index),
             "finish_reason": e.finish_reason, "n": int(t.size), "crc": _crc((t, lp, v))}
        if e.reward is not None or e.failed:          # a finished episode's outcome
            m.update(reward=float(e.reward or 0.0), failed=bool(e.failed))
        meta.append(m)
    header = json.dumps({"format": FORMAT, "replica": replica, "launch": launch,
                         "entries": meta})
    buf = io.BytesIO()
    np.savez(buf, header=np.frombuffer(header.encode("utf-8"), np.uint8), **arrays)
    return buf.getvalue()


def decode(data: bytes) -> tuple[list[JournalEntry], int]:
    """``(entries, damaged)`` of one journal file's bytes: the entries that check out, and
    the number skipped (1 for a file that cannot be read at all). Never raises."""
    try:
        z = np.load(io.BytesIO(data), allow_pickle=False)
        header = json.loads(bytes(z["header"]).decode("utf-8"))
        if header.get("format") != FORMAT or not isinstance(header.get("entries"), list):
            return [], 1
        meta, launch = header["entries"], str(header.get("launch", ""))
    except Exception:  # noqa: BLE001 - any damage to the file is counted, never fatal
        return [], 1
    out, damaged = [], 0
    for i, m in enumerate(meta):
        try:
            t, lp, v = (z[f"{k}{i}"] for k in "tlv")
            n = int(m["n"])
            reward = m.get("reward")
            ok = (t.dtype == np.int32 and lp.dtype == np.float32 and v.dtype == np.int32
                  and t.shape == lp.shape == v.shape == (n,) and _crc((t, lp, v)) == m["crc"]
                  and m["finish_reason"] in ("", "stop", "length")
                  and (reward is None or np.isfinite(float(reward)))
                  and isinstance(m.get("failed", False), bool))
            if ok:
                out.append(JournalEntry(int(m["stream_index"]), int(m["seed"]),
                                        int(m["prompt_id"]), int(m["sample_index"]),
                                        t, lp, v, m["finish_reason"], launch,
                                        None if reward is None else float(reward),
                                        m.get("failed", False)))
                continue
        except Exception:  # noqa: BLE001 - a damaged entry is skipped and counted
            pass
        damaged += 1
    return out, damaged


def journal_path(run_path: str, replica: str) -> str:
    return files.join(run_path, FOLDER, f"{replica}.npz")


def write_journal(run_path: str, replica: str, entries: Sequence[JournalEntry],
                  launch: str = "") -> None:
    """Replace ``replica``'s journal in ``run_path`` (atomically; the folder made first);
    ``launch``: the run's launch writing it (:class:`JournalEntry`).

    Raises:
      OSError: the run folder cannot be written (``rlflow.run.files.write_atomic``).
    """
    files.makedirs(files.join(run_path, FOLDER))
    files.write_atomic(journal_path(run_path, replica), encode(replica, entries, launch))


def read_journal(run_path: str, replica: str) -> tuple[list[JournalEntry], int]:
    """``replica``'s journal in ``run_path``: ``(entries, damaged)``; none: ``([], 0)``."""
    p = journal_path(run_path, replica)
    try:
        if not files.isfile(p):
            return [], 0
        return decode(files.read_bytes(p))
    except OSError:
        return [], 1


def read_journals(run_path: str, exclude: Sequence[str] = ()
                  ) -> tuple[dict[tuple[int, int], list[JournalEntry]], int]:
    """Every replica's journal in ``run_path`` but those of the replicas named in
    ``exclude``: ``({(stream_index, seed): entries}, damaged)`` (entries of one sample in
    several journals: :func:`merge`). No journal folder: ``({}, 0)``."""
    folder = files.join(run_path, FOLDER)
    if not files.isdir(folder):
        return {}, 0
    by_key: dict[tuple[int, int], list[JournalEntry]] = {}
    damaged = 0
    skip = {f"{r}.npz" for r in exclude}
    for name in sorted(n for n in files.listdir(folder) if n.endswith(".npz")):
        if name in skip:
            continue
        try:
            data = files.read_bytes(files.join(folder, name))
        except OSError:
            damaged += 1
            continue
        entries, bad = decode(data)
        damaged += bad
        merge(by_key, entries)
    return by_key, damaged


def merge(by_key: dict, entries: Sequence[JournalEntry]) -> None:
    """Add ``entries`` to ``by_key`` (``{(stream_index, seed): [entry per sample]}``, in
    place): of two entries of one sample (journals of two replicas that held the prompt one
    after the other) the finished one is kept, else the longer (more decoded), else the one
    already there."""
    for e in entries:
        have = by_key.setdefault(e.key, [])
        for j, x in enumerate(have):
            if x.sample_index == e.sample_index:
                if (bool(e.finish_reason), e.tokens.size) > (bool(x.finish_reason),
                                                             x.tokens.size):
                    have[j] = e
                break
        else:
            have.append(e)


def stale(entries: Sequence[JournalEntry], version: int, max_staleness: int) -> bool:
    """Whether a prompt's partial generation is older than the staleness bound: its oldest
    sampled token's policy version lags ``version`` by more than ``max_staleness`` (the rule
    the learner applies to a finished sample, counted on the versions the tokens were
    sampled with; an episode's environment tokens, version -1, are not sampled and do not
    count)."""
    oldest = oldest_version(entries)
    return oldest is not None and version - oldest > max_staleness


def oldest_version(samples) -> Optional[int]:
    """The oldest policy version of the sampled tokens (``versions >= 0``) of ``samples``
    (anything with a ``versions`` array: entries, completions); None when none is sampled."""
    oldest: Optional[int] = None
    for e in samples:
        v = np.asarray(e.versions)
        v = v[v >= 0]
        if v.size:
            oldest = int(v.min()) if oldest is None else min(oldest, int(v.min()))
    return oldest
