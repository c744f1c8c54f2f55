"""Sampler replica figures as learner metrics (pure: statuses in, metric dict out).

Per replica ``i`` (``sampler-<i>``): ``replica/<i>/tokens_per_s``, ``slot_occupancy``,
``groups_delivered`` (total), ``in_flight`` (groups it holds), ``version`` (policy version
of its weights), ``restarts``. Over the live replicas: ``sampler/tokens_per_s`` (sum),
``sampler/slot_occupancy``, ``sampler/idle_frac`` and ``sampler/tokens_per_s_per_chip`` (means), the groups dropped for a
NaN/inf reward (``sampler/dropped_bad_reward_groups``), the reward functions' error and
timeout counts (``reward/errors/<fn>``, ``reward/timeouts/<fn>``), the multi-turn episode
counters ``sampler/env_*``, ``sampler/episodes*`` and the environments' ``env/*`` info sums
(sums: each a total of the replica's current instance), ``sampler/version`` (newest),
``sampler/replicas_alive``, ``replica/<i>/lost`` for every replica the learner has
declared lost for silence (times, ``runtime.replica_timeout_s``; live or not) and their sum
``sampler/replicas_lost``, and the ``sync/*`` swap figures of the replica that reported
last, with ``sync/weight_sync_s`` = its swap time minus the publish time of the version it
swapped in.
"""

from __future__ import annotations

from typing import Mapping

# tokens/s per chip: the replicas' mean (= the fleet's tokens/s per chip when every replica
# has the same mesh, as the config makes them)
_MEAN = ("sampler/slot_occupancy", "sampler/idle_frac", "sampler/tokens_per_s_per_chip")
_SUM = ("sampler/tokens_per_s", "sampler/rejected_groups", "sampler/in_flight",
        "sampler/groups_delivered", "sampler/dropped_bad_reward_groups",
        # multi-turn episodes (totals per replica instance): environment steps, failures
        # (reward 0, counted), episodes started and cut by a limit
        "sampler/env_steps", "sampler/env_errors", "sampler/env_timeouts",
        "sampler/env_reset_errors", "sampler/episodes", "sampler/episodes_cut_turns",
        "sampler/episodes_cut_tokens")


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
    for key in _SUM:
        vals = [f[key] for f in figures.values() if key in f]
        if vals:
            out[key] = float(sum(vals))
    summed = ("env/", "reward/errors/", "reward/timeouts/")   # environments' info, rewards'
    for key in sorted({k for f in figures.values() for k in f if k.startswith(summed)}):
        out[key] = float(sum(f.get(key, 0.0) for f in figures.values()))
    for key in _MEAN:
        vals = [f[key] for f in figures.values() if key in f]
        if vals:
            out[key] = float(sum(vals) / len(vals))
    versions = [st.version for st in statuses.values() if st.version >= 0]
    if versions:                   # -1: a (re)started replica before its first pull
        out["sampler/version"] = float(max(versions))
    for name, st in statuses.items():
        i, f = _index(name), figures[name]
        for key in ("tokens_per_s", "slot_occupancy", "groups_delivered", "in_flight"):
            if f"sampler/{key}" in f:
                out[f"replica/{i}/{key}"] = f[f"sampler/{key}"]
        if st.version >= 0:
            out[f"replica/{i}/version"] = float(st.version)
        out[f"replica/{i}/restarts"] = float(restarts.get(name, 0))
    last = max(statuses.values(), key=lambda s: s.received)
    lf = figures[last.consumer]
    out.update({k: v for k, v in lf.items()
                if k.startswith("sync/") or k == "sampler/instance"})
    swap_v, swap_t = out.get("sync/swap_version"), out.pop("sync/swap_time", None)
    if swap_v is not None and swap_t is not None and int(swap_v) in publish_time:
        out["sync/weight_sync_s"] = max(0.0, swap_t - publish_time[int(swap_v)])
    return out
