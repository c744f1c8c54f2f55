"""rlflow.control.evals.EvalSchedule: which replica runs which evaluation, results, a lost
replica's evaluation retried, a silent one given up; and its wiring into the run control."""

import pytest

from rlflow.control.evals import EvalSchedule, result_metrics


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _result(requested, version, n=2, correct=(True, False)):
    return {"requested": requested, "version": version,
            "records": [{"prompt_id": i, "rewards": [1.0 if c else 0.0], "correct": [c],
                         "lengths": [3], "truncated": [False], "answers": ["x"]}
                        for i, c in zip(range(n), correct)]}


def test_requests_only_multiples_once_and_assigns_to_a_replica_that_holds_the_version():
    s = EvalSchedule(every_steps=2, num_prompts=2, timeout_s=60, clock=Clock())
    assert [s.request(v) for v in (0, 1, 2, 2, 3, 4)] == [True, False, True, False, False, True]
    assert s.pending == 3
    assert s.assign("a", 0) == 0                 # the oldest it can run
    assert s.assign("a", 5) == 0                 # one at a time: the same one again
    assert s.assign("b", 1) == -1                # version 2 needs weights >= 2
    assert s.assign("b", 3) == 2
    assert s.assign("c", 4) == 4
    assert not s.deliver("b", _result(0, 0))      # not b's
    assert not s.deliver("a", _result(0, 0, n=1, correct=(True,)))   # wrong prompt count
    assert s.deliver("a", _result(0, 0)) and s.deliver("b", _result(2, 3))
    done = s.take_finished()
    assert [(r.requested, r.version, r.replica, r.complete) for r in done] == [
        (0, 0, "a", True), (2, 3, "b", True)]
    assert s.take_finished() == [] and s.pending == 1
    step, metrics = result_metrics(done[1])
    assert step == 3 and metrics["eval/version"] == 3 and metrics["eval/requested_version"] == 2
    assert metrics["eval/pass@1"] == 0.5 and metrics["eval/complete"] == 1.0


def test_a_lost_replica_gives_its_evaluation_back_and_a_silent_one_is_given_up():
    clock = Clock()
    s = EvalSchedule(every_steps=1, num_prompts=2, timeout_s=10, clock=clock)
    s.request(0)
    s.request(1)
    assert s.assign("a", 1) == 0 and s.assign("b", 1) == 1
    assert s.release("a") == 1 and s.release("a") == 0
    assert not s.deliver("a", _result(0, 1))      # late result of the lost replica: ignored
    assert s.assign("c", 1) == 0
    assert s.deliver("c", _result(0, 1))
    clock.t = 10.5                                # b never answers
    done = s.take_finished()
    assert [(r.requested, r.complete, r.attempts) for r in done] == [(0, True, 2), (1, False, 1)]
    assert s.pending == 0
    step, metrics = result_metrics(done[1])
    assert step == 1 and metrics["eval/complete"] == 0.0 and "eval/pass@1" not in metrics


def test_run_control_hands_out_evaluations_and_takes_results():
    from rlflow.control.run_control import ControlClient, RunCoordinator

    class Offers:
        def latest(self, *a, **k):
            return {}

    s = EvalSchedule(every_steps=1, num_prompts=2, timeout_s=60, clock=Clock())
    s.request(0)
    coord = RunCoordinator(Offers(), buffer_counts=lambda: (0, 0), evals=s).start()
    client = ControlClient(coord.address, consumer_id="sampler-0", timeout_s=30)
    try:
        assert client.status(version=-1).eval_version == -1     # no weights yet
        assert client.status(version=0).eval_version == 0
        reply = client.status(version=0, eval_results=[_result(0, 0)])
        assert reply.eval_version == -1
        assert [(r.requested, r.replica) for r in s.take_finished()] == [(0, "sampler-0")]
    finally:
        client.close()
        coord.close()


def test_run_control_gives_a_restarted_or_silent_replicas_evaluation_to_the_next():
    """A replica that restarts (new instance) or falls silent past the replica timeout loses
    its evaluation; the next replica that asks runs it; the lost one's late result is
    ignored and the run gets exactly one result per version."""
    from rlflow.control.run_control import ControlClient, RunCoordinator
    from rlflow.control.replicas import ReplicaTable

    class Offers:
        def latest(self, *a, **k):
            return {}

    clock = Clock()
    s = EvalSchedule(every_steps=1, num_prompts=2, timeout_s=1e6, clock=clock)
    s.request(0)
    s.request(1)
    coord = RunCoordinator(Offers(), buffer_counts=lambda: (0, 0), evals=s,
                           replicas=ReplicaTable(5.0, clock()), clock=clock).start()
    clients = {}

    def status(name, instance=0, **kw):
        key = (name, instance)
        if key not in clients:
            clients[key] = ControlClient(coord.address, consumer_id=name, instance=instance,
                                         timeout_s=30)
        return clients[key].status(**kw).eval_version

    try:
        assert status("sampler-0", version=1) == 0
        assert status("sampler-1", version=1) == 1
        assert status("sampler-0", instance=1, version=1) == 0     # restarted: 0 again
        assert s.take_finished() == []
        clock.t = 3.0
        status("sampler-0", instance=1, version=1)                 # alive; sampler-1 silent
        clock.t = 7.0
        coord.tick()                                               # sampler-1 is lost
        assert status("sampler-0", instance=1, version=1,
                      eval_results=[_result(0, 1)]) == 1           # then takes over 1
        assert status("sampler-1", version=1, eval_results=[_result(1, 1)]) == -1
        assert [(r.requested, r.replica) for r in s.take_finished()] == [(0, "sampler-0")]
        status("sampler-0", instance=1, version=1, eval_results=[_result(1, 1)])
        assert [(r.requested, r.replica, r.attempts) for r in s.take_finished()] == [
            (1, "sampler-0", 2)]
    finally:
        for c in clients.values():
            c.close()
        coord.close()
