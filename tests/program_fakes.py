"""Stand-ins for a :class:`rlflow.learner.program.LearnerProgram`'s buffer, learner, publisher,
coordinator and metrics writer: the program's own step logic (taking groups, prefetching,
skips, the prompt ledger, publishing) runs against them without processes or a model."""

import tempfile

import numpy as np

from rlflow.exchange.ring import BufferTimeoutError
from rlflow.learner.batch import BatchSpec, build_batch
from rlflow.learner.program import LearnerProgram
from rlflow.learner.skips import FilterStreak, SkipCounter
from rlflow.control.ledger import PromptLedger, TrainedPromptsLog
from rlflow.control.replica_metrics import StepRates


class ListBuffer:
    def __init__(self, groups):
        self.groups = list(groups)

    def get_groups(self, n, *, timeout, accept):
        """As RingBuffer.get_groups, without waiting: BufferTimeoutError when it runs out."""
        out = []
        while len(out) < n:
            if not self.groups:
                self.groups[:0] = out
                raise BufferTimeoutError("producer", f"{len(out)} of {n} groups")
            g = self.groups.pop(0)
            if accept(g):
                out.append(g)
        return out

    def metrics(self):
        return dict(fill_fraction=0.0, producer_wait_s=0.0, consumer_wait_s=0.0,
                    dropped_full=0, rejected=0)


class FakeLearner:
    """build_batch is the real one; dispatch() takes an update (version + 1)."""

    def __init__(self, cfg):
        self.spec, self.version, self.updates = BatchSpec.from_config(cfg), 0, 0
        self.params = None
        self.last_compile_s = 0.0

    def build_batch(self, recs, version=None):
        return build_batch(recs, self.spec, self.version if version is None else version)

    def check_batch(self, batch):
        return batch

    def dispatch(self, batch, checked=False):
        self.version += 1
        self.updates += 1
        return {"learner/skipped": 0.0}

    def perf_metrics(self, info, seconds):
        return {}                         # no model: no FLOPs to count


class _Publisher:
    def __init__(self):
        self.published, self.publish_time = [], {}
        self.bytes = 0                 # bytes of the last published version (as the program's)

    def publish(self, version, params):
        if self.published and version <= self.published[-1]:
            raise AssertionError(f"publishing {version} after {self.published[-1]}")
        self.published.append(version)

    def transfer_metrics(self):
        return {}


class _Coordinator:
    published_version, data_state = 0, None

    def set_progress(self, **kw):
        pass

    def latest_status(self):
        return None

    def check_replicas(self):
        pass

    def live_statuses(self):
        return {}

    def restarts(self):
        return {}

    def timeouts(self):
        return {}


class _Writer:
    def __init__(self):
        self.logged = []

    def log(self, step, metrics):
        self.logged.append((step, metrics))

    def samples_due(self, step):
        return False


def stand_in_program(cfg, groups, learner=None):
    """A :class:`LearnerProgram` over stand-ins: ``groups`` in a list buffer, every one a leased
    and stored prompt of a real :class:`PromptLedger`; the learner ``learner`` (default
    :class:`FakeLearner`)."""
    p = object.__new__(LearnerProgram)
    gps = cfg.learner.groups_per_step
    p.cfg, p.gps, p.version, p.start_step = cfg, gps, 0, 0
    p.learner, p.buffer = learner or FakeLearner(cfg), ListBuffer(groups)
    p.publisher, p.coordinator, p.writer = _Publisher(), _Coordinator(), _Writer()
    p.publisher.published.append(0)                  # version 0 went out at start-up
    p.counts = dict(accepted=0, stale_groups=0, zero_variance_groups=0)
    p.skips, p.filter_streak = SkipCounter(cfg), FilterStreak(cfg)
    p.threshold, p._last_buffer = 1.0, p.buffer.metrics()
    p.reasoning = None                                # not a thinking model
    p.rates = StepRates(0.0)                          # sampler rates (no replica here)
    # the prompt ledger: every group is a leased, stored prompt
    p.ledger = PromptLedger(lambda i: {}, None, groups_per_step=gps, max_staleness=0,
                            seed_of=lambda i: i)
    for g in groups:
        (e,) = p.ledger.lease("sampler-0", 10**6, 1)
        g["stream_index"] = np.asarray(e["stream_index"], np.int64)
        g["lease_id"] = np.asarray(e["lease_id"], np.int64)
        assert p.ledger.stored((e["stream_index"], e["lease_id"]))
    p.batch_keys, p.steps_marked, p.prompts_per_epoch, p.prompt_counts = [], 0, 1, {}
    p.trained_log = TrainedPromptsLog(tempfile.mkdtemp(prefix="rlflow-skips-"), 0)
    return p
