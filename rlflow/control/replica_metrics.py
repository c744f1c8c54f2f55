"""Sampler replica figures as learner metrics (pure: statuses in, metric dict out).

Per replica ``i`` (``sampler-<i>``): ``groups_delivered`` (total), ``in_flight`` (groups it
holds), ``version`` (policy version of its weights), ``restarts``. Over the live replicas:
the groups dropped for a
NaN/inf reward (``sampler/dropped_bad_reward_groups``), the reward functions' error and
timeout counts (``reward/errors/<fn>``, ``reward/timeouts/<fn>``), the served rewards' tries
(``reward/http_requests|retries|timeouts|errors/<name>``), the multi-turn episode
counters ``sampler/env_*``, ``sampler/episodes*``, the environments' ``env/*`` info sums and
the agent gateway's ``gateway/*`` counters (sums: each a total of the replica's current
instance), ``sampler/journal_lag_max`` (the largest), ``sampler/version`` (newest),
``sampler/replicas_alive``, ``replica/<i>/lost`` for every replica the learner has
declared lost for silence (times, ``runtime.replica_timeout_s``; live or not) and their sum
``sampler/replicas_lost``, and the ``sync/*`` swap figures and the ``sampler/weight_*``
pause per version (``rlflow.sampler.weight_pause``) of the replica that reported last, with ``sync/weight_sync_s`` = its swap time minus the publish time of the version it
swapped in.

Rates (:class:`StepRates`): each replica reports running totals (tokens decoded, slot-steps
used and run, seconds idle; :class:`rlflow.sampler.background.RateCounters`); the learner
turns their growth over each logged step's interval (at least ``MIN_RATE_SPAN_S``) into
the rates of that interval:
``sampler/tokens_per_s`` (sum over replicas), ``sampler/tokens_per_s_per_chip`` (that sum
over the replicas' devices, ``sampler/chips``), ``sampler/slot_occupancy`` (slot-steps used /
run), ``sampler/idle_frac`` (mean over replicas), ``replica/<i>/tokens_per_s`` and
``replica/<i>/slot_occupancy``; and over the run so far: ``sampler/tokens_total`` and
``sampler/tokens_per_s_run`` (tokens / seconds since the learner started).
"""

from __future__ import annotations

import collections
from typing import Mapping

_SUM = ("sampler/rejected_groups", "sampler/in_flight",
        "sampler/groups_delivered", "sampler/dropped_bad_reward_groups",
        # multi-turn episodes (totals per replica instance): environment steps, failures
        # (reward 0, counted), episodes started and cut by a limit
        "sampler/env_steps", "sampler/env_errors", "sampler/env_timeouts",
        "sampler/env_reset_errors", "sampler/episodes", "sampler/episodes_cut_turns",
        "sampler/episodes_cut_tokens", "sampler/reward_failed_samples",
        "sampler/episodes_reasoning_unclosed",
        # episodes resumed from the journal of partial generations (rlflow.sampler.episodes)
        "sampler/episodes_resumed", "sampler/episodes_replayed_steps",
        "sampler/episodes_replay_mismatch",
        # the journal of partial generations (rlflow.sampler.journal_keeper)
        "sampler/journal_writes", "sampler/journal_write_waits", "sampler/journal_snapshot_s",
        "sampler/journal_write_s", "sampler/journal_write_errors",
        "sampler/journal_resumed_samples", "sampler/journal_resumed_tokens",
        "sampler/journal_damaged", "sampler/journal_dropped_stale", "sampler/journal_refreshes")
#: Figures whose maximum over the live replicas is logged.
_MAX = ("sampler/journal_lag_max",)


def _index(name: str) -> str:
    return name.rsplit("-", 1)[-1]


def replica_metrics(statuses: Mapping, restarts: Mapping[str, int],
                    publish_time: Mapping[int, float],
                    timeouts: Mapping[str, int] | None = None) -> dict:
    """Metrics of the live replicas' latest statuses (``SamplerStatus`` by name);
    ``timeouts``: replica name -> times declared lost for silence (any replica)."""
    lost = {n: k for n, k in (timeouts or {}).items() if k}
    out: dict = {"sampler/replicas_alive": float(len(statuses))}
    if lost:
        out["sampler/replicas_lost"] = float(sum(lost.values()))
        out.update({f"replica/{_index(n)}/lost": float(k) for n, k in lost.items()})
    if not statuses:
        return out
    figures = {name: {k: float(v) for k, v in st.metrics.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for name, st in statuses.items()}
    for keys, fold in ((_SUM, sum), (_MAX, max)):
        for key in keys:
            vals = [f[key] for f in figures.values() if key in f]
            if vals:
                out[key] = float(fold(vals))
    # environments' info, reward functions' failures (training's and the held-out
    # evaluations', rlflow.sampler.eval_runner.EvalRunner.metrics), served rewards' tries
    # and the agent gateway's counters (rlflow.gateway: calls, sessions, branches, ...)
    summed = ("env/", "reward/errors/", "reward/timeouts/", "reward/http_", "eval/reward_",
              "gateway/")
    for key in sorted({k for f in figures.values() for k in f if k.startswith(summed)}):
        out[key] = float(sum(f.get(key, 0.0) for f in figures.values()))
    versions = [st.version for st in statuses.values() if st.version >= 0]
    if versions:                   # -1: a (re)started replica before its first pull
        out["sampler/version"] = float(max(versions))
    for name, st in statuses.items():
        i, f = _index(name), figures[name]
        for key in ("groups_delivered", "in_flight"):
            if f"sampler/{key}" in f:
                out[f"replica/{i}/{key}"] = f[f"sampler/{key}"]
        if st.version >= 0:
            out[f"replica/{i}/version"] = float(st.version)
        out[f"replica/{i}/restarts"] = float(restarts.get(name, 0))
    last = max(statuses.values(), key=lambda s: s.received)
    lf = figures[last.consumer]
    out.update({k: v for k, v in lf.items()
                if k.startswith(("sync/", "sampler/weight_")) or k == "sampler/instance"})
    swap_v, swap_t = out.get("sync/swap_version"), out.pop("sync/swap_time", None)
    if swap_v is not None and swap_t is not None and int(swap_v) in publish_time:
        out["sync/weight_sync_s"] = max(0.0, swap_t - publish_time[int(swap_v)])
    return out


#: The running totals a replica reports (:class:`rlflow.sampler.background.RateCounters`).
_TOTALS = ("sampler/tokens_total", "sampler/slot_steps_used", "sampler/slot_steps_total",
           "sampler/idle_s_total")
_CHIPS = "sampler/chips"          # devices of a replica's mesh (constant per replica)


#: Shortest span (seconds) a rate is averaged over: a learner step can take 20 ms while a
#: replica decodes in bursts, and a rate over 20 ms between two bursts would read 0.
MIN_RATE_SPAN_S = 1.0


class StepRates:
    """Sampler rates averaged over each learner step's interval (at least
    :data:`MIN_RATE_SPAN_S`) and over the run, from the replicas' running totals (see the
    module docstring).

    The totals are known at the replicas' status reports (``SamplerStatus.received``,
    ``time.time()`` seconds, every 5-100 ms), so a replica's rates at a step are the growth
    of its totals from the report nearest before ``max(step interval, MIN_RATE_SPAN_S)``
    ago to its newest report, over the time between those two reports. A replica's totals
    count from its (re)start: a new ``sampler/instance`` or a total that went down starts
    its count again from 0, so a restart adds what the new instance decoded and never a
    negative amount.

    Args:
      now: the learner's start (``time.time()`` seconds): a replica's first interval and
        the run average count from it.
    """

    def __init__(self, now: float):
        self.t_start = self.t_step = float(now)
        self.instance: dict = {}   # replica -> sampler/instance of its reports
        self.history: dict = {}    # replica -> deque of (received, totals), oldest first
        self.run_tokens = 0.0

    def _add_report(self, name: str, instance, received: float, totals: tuple) -> None:
        history = self.history.get(name)
        if history is None or instance != self.instance.get(name) or \
                any(a < b for a, b in zip(totals, history[-1][1])):
            since = history[-1][0] if history else self.t_start
            history = self.history[name] = collections.deque([(since, (0.0,) * len(totals))])
            self.instance[name] = instance
        self.run_tokens += totals[0] - history[-1][1][0]
        history.append((received, totals))

    def _rates(self, name: str, span: float) -> tuple:
        """(tokens/s, slot-steps used, slot-steps run, idle fraction) of ``name`` over its
        last ``span`` seconds of reports (the older ones dropped)."""
        history = self.history[name]
        newest_t, newest = history[-1]
        while len(history) > 2 and history[1][0] <= newest_t - span:
            history.popleft()                 # the reference: the last report >= span ago
        ref_t, ref = history[0]
        dt = max(newest_t - ref_t, 1e-9)
        growth = [a - b for a, b in zip(newest, ref)]
        return growth[0] / dt, growth[1], growth[2], min(1.0, growth[3] / dt)

    def update(self, statuses: Mapping, now: float) -> dict:
        """Rates at a logged step from the replicas' latest statuses (``SamplerStatus`` by
        name: ``metrics`` holding the totals, ``received``); ``now``: ``time.time()``.
        Returns the rate metrics (floats; none when no replica reports totals)."""
        span = max(float(now) - self.t_step, MIN_RATE_SPAN_S)
        self.t_step = float(now)
        live = []
        for name, st in statuses.items():
            m = st.metrics
            if "sampler/tokens_total" not in m:
                continue
            received = float(st.received) or float(now)
            history = self.history.get(name)
            if history is None or received > history[-1][0]:
                self._add_report(name, m.get("sampler/instance", 0.0), received,
                                 tuple(float(m.get(k, 0.0)) for k in _TOTALS))
            live.append(name)
        if not live:
            return {}
        rates = {name: self._rates(name, span) for name in live}
        chips = sum(max(float(statuses[name].metrics.get(_CHIPS, 1.0)), 1.0) for name in live)
        used, run = sum(r[1] for r in rates.values()), sum(r[2] for r in rates.values())
        tokens_per_s = sum(r[0] for r in rates.values())
        out = {"sampler/tokens_per_s": tokens_per_s,
               "sampler/tokens_per_s_per_chip": tokens_per_s / chips,
               "sampler/slot_occupancy": used / run if run else 0.0,
               "sampler/idle_frac": sum(r[3] for r in rates.values()) / len(rates),
               "sampler/tokens_total": self.run_tokens,
               "sampler/tokens_per_s_run": self.run_tokens / max(float(now) - self.t_start,
                                                                 1e-9)}
        for name, r in rates.items():
            out[f"replica/{_index(name)}/tokens_per_s"] = r[0]
            out[f"replica/{_index(name)}/slot_occupancy"] = r[1] / r[2] if r[2] else 0.0
        return out
