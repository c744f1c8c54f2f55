"""A learner of several hosts: its config checks and the launcher's pieces (no processes;
the end-to-end run is tests/e2e/test_learner_hosts_e2e.py)."""

import pytest

from rlflow.control import programs_common as pc
from rlflow.config import (CheckpointConfig, ConfigError, ExperimentConfig, LearnerConfig, MeshConfig,
                           RuntimeConfig, SamplerConfig, replace)
from rlflow.learner import multihost
from rlflow.system.ports import free_port
from rlflow.launcher import launch, learner_hosts


def two_hosts(**runtime):
    return ExperimentConfig(
        learner=LearnerConfig(num_devices=2, mesh=MeshConfig(fsdp=2), num_hosts=2),
        runtime=RuntimeConfig(**runtime))


def test_num_hosts_must_divide_the_devices_and_fit_the_weight_path():
    assert two_hosts().learner.num_hosts == 2
    with pytest.raises(ConfigError, match=r"learner.num_hosts: must divide "
                                          r"learner.num_devices=2 .* got 3"):
        LearnerConfig(num_devices=2, mesh=MeshConfig(fsdp=2), num_hosts=3)
    with pytest.raises(ConfigError, match="learner.num_hosts"):
        LearnerConfig(num_hosts=0)
    with pytest.raises(ConfigError, match="runtime.weight_transfer: must be 'transfer' with "
                                          "learner.num_hosts=2"):
        two_hosts(weight_transfer="orbax")
    for fanout in (0, 2):        # relayed per learner host (tests/unit/exchange/test_relay.py) or not
        replace(two_hosts(relay_fanout=fanout), sampler=SamplerConfig(num_replicas=2))
    with pytest.raises(ConfigError, match="checkpoint.keep_best_metric: is not supported with "
                                          "learner.num_hosts=2"):
        replace(two_hosts(), checkpoint=CheckpointConfig(keep_best_metric="reward/mean"))


def test_launcher_names_and_environment_of_each_host():
    assert learner_hosts.learner_names(1) == ["learner"]
    assert learner_hosts.learner_names(3) == ["learner", "learner-1", "learner-2"]
    assert learner_hosts.host_label("learner-2", 77, 3) == "learner host 2 (pid 77)"
    assert learner_hosts.host_label("learner", 76, 3) == "learner host 0 (pid 76)"
    assert learner_hosts.host_label("learner", 76, 1) == "learner"
    assert learner_hosts.host_env("learner", 1, "x:1") == {}
    assert learner_hosts.host_env("learner-1", 2, "127.0.0.1:9") == {
        pc.ENV_NUM_PROCESSES: "2", pc.ENV_PROCESS_ID: "1", pc.ENV_DIST_COORDINATOR: "127.0.0.1:9"}


def test_slice_size_must_match_the_config():
    with pytest.raises(ValueError, match=r"RLFLOW_NUM_PROCESSES=4 hosts .* "
                                         r"learner.num_hosts=2: set --learner.num-hosts 4"):
        learner_hosts.join_slice(two_hosts(), {pc.ENV_NUM_PROCESSES: "4"})
    assert learner_hosts.join_slice(ExperimentConfig(), {}) == 0


def test_a_host_that_cannot_reach_the_coordinator_fails_through_the_launch_entry(monkeypatch):
    """``python -m rlflow.launcher.launch --role learner`` on host 1 whose coordinator never
    answers: CoordinatorUnreachable naming the host and address after the timeout."""
    port = free_port()
    for key, value in {pc.ENV_NUM_PROCESSES: "2", pc.ENV_PROCESS_ID: "1",
                       pc.ENV_DIST_COORDINATOR: f"127.0.0.1:{port}",
                       "RLFLOW_JAX_INIT_TIMEOUT_S": "1.5"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(multihost.CoordinatorUnreachable,
                       match=rf"learner host 1: coordinator 127.0.0.1:{port} .* within 1.5 s"):
        launch.run_role("learner", two_hosts(), pc.Endpoints("127.0.0.1:1", "127.0.0.1:2"))


def test_a_failed_collective_is_found_in_the_exception_chain():
    """What makes a learner host exit at once (``run_learner``): a JaxRuntimeError anywhere
    in the chain, e.g. the launcher's SIGTERM arriving while the exit checkpoint waits for a
    host that died (the case the 2-host e2e test kills)."""
    import jax

    gloo = jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection reset by peer")
    assert learner_hosts.failed_collective(gloo) is gloo
    try:
        try:
            raise gloo
        except jax.errors.JaxRuntimeError:
            raise pc.Stopped("received SIGTERM")         # raised during the handling
    except pc.Stopped as e:
        stopped = e
    assert learner_hosts.failed_collective(stopped) is gloo
    caused = RuntimeError("step failed")
    caused.__cause__ = gloo
    assert learner_hosts.failed_collective(caused) is gloo
    assert learner_hosts.failed_collective(pc.Stopped("received SIGTERM")) is None
    assert learner_hosts.failed_collective(ValueError("a bad record")) is None
    looped = ValueError("a")
    looped.__context__ = ValueError("b")
    looped.__context__.__context__ = looped            # a cycle ends the walk
    assert learner_hosts.failed_collective(looped) is None


_LEAVE = """
import logging, sys, threading, types
from rlflow.launcher import learner_hosts
logging.basicConfig(level=logging.INFO)          # the program's logging (setup_logging)
trainer = types.ModuleType("rlflow.learner.trainer")   # only its thread name is read
trainer.COMPILE_THREAD_NAME = {name!r}
sys.modules["rlflow.learner.trainer"] = trainer
never = threading.Event()
threading.Thread(target=never.wait, name={name!r}).start()           # a compile, not a daemon
if {other}:
    threading.Thread(target=never.wait, args=(0.5,), name="other").start()
learner_hosts.leave_background_compiles(3)
print("returned", flush=True)
never.set()
"""


@pytest.mark.parametrize("other", [False, True])
def test_a_finished_learner_leaves_only_background_compiles_behind(other):
    """``python -m rlflow.launcher.launch`` ends a learner whose only running threads are
    background compiles with its exit code at once (the interpreter would wait for them);
    any other non-daemon thread still running means a normal exit."""
    import subprocess
    import sys

    from rlflow.learner.trainer import COMPILE_THREAD_NAME

    code = _LEAVE.format(name=COMPILE_THREAD_NAME, other=other)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    if other:
        assert (done.returncode, done.stdout) == (0, "returned\n"), done.stderr
    else:
        assert (done.returncode, done.stdout) == (3, ""), done.stderr
        assert "exiting without waiting for 1 background compile(s)" in done.stderr


_WAIT_IN_A_BARRIER = """
import logging, select, signal
from rlflow.launcher import learner_hosts
logging.basicConfig(level=logging.INFO)
signal.signal(signal.SIGTERM, lambda signum, frame: None)   # the program's own handler
learner_hosts.watch_for_lost_peer()
print("waiting", flush=True)
while True:                   # the main thread in a wait of its own, as in a barrier
    select.select([], [], [], 3600)
"""


def test_a_host_waiting_in_a_barrier_leaves_when_told_a_peer_died():
    """The launcher's PEER_LOST_SIGNAL ends a learner host with code 1 even while its main
    thread waits (Python runs no handler there); another signal (SIGTERM) does not."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _WAIT_IN_A_BARRIER], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline() == "waiting\n"
        child.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)                   # still waiting: SIGTERM is not it
        told = learner_hosts.notify_lost_peer({"learner": child, "learner-1": child,
                                               "sampler-0": child}, "learner-1")
        assert told == ["learner"]                    # the lost host and samplers: not told
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 1, err
    assert "another host of the learner slice died" in err


@pytest.mark.parametrize("replicas, fanout, relayed", [(3, 2, True), (3, 0, False),
                                                       (1, 2, False)])
def test_every_learner_host_and_every_replica_use_the_same_relay_rule(monkeypatch, replicas,
                                                                      fanout, relayed):
    """With several replicas and relay_fanout > 0, learner host 0's offers, a follower
    host's weight coordinator and each replica's per-host subscribers all relay (one relay
    tree per learner host, tests/unit/exchange/test_relay.py); otherwise none of them does."""
    from rlflow.exchange.host_shards import HostShardPuller
    from rlflow.exchange.relay import RelayOffers
    from rlflow.learner import hosts
    from rlflow.learner.publish import relay_offers
    from rlflow.sampler.subscribe import weight_subscriber

    cfg = replace(two_hosts(relay_fanout=fanout), sampler=SamplerConfig(num_replicas=replicas))

    class Publisher:
        version, nbytes, layout_desc = -1, 0, {}

        def offer(self, consumer, have_version):
            return {"version": self.version}

    pub = Publisher()
    assert isinstance(relay_offers(cfg, pub), RelayOffers) == relayed
    if relayed:
        assert relay_offers(cfg, pub).fanout == fanout
        assert relay_offers(cfg, pub).num_consumers == replicas
    else:
        assert relay_offers(cfg, pub) is pub
    # a follower host (jax.process_index() 1): its weight coordinator serves the same offers
    monkeypatch.setattr(hosts.HostCommands, "__init__", lambda self: setattr(self, "leader", False))
    monkeypatch.setattr(hosts, "gather_addresses", lambda address: ["", address])
    follower = hosts.LearnerHosts(cfg, "127.0.0.1", pub)
    try:
        assert isinstance(follower.coordinator.publisher, RelayOffers) == relayed
    finally:
        follower.coordinator.close()
    # a replica: one subscriber per learner host, each relaying what it pulls
    puller = weight_subscriber(cfg, "tcp://127.0.0.1:1", None, consumer_id="sampler-0#0",
                               weight_hosts=["127.0.0.1:2"])
    try:
        assert isinstance(puller, HostShardPuller) and len(puller.subscribers) == 2
        assert [s.relay_fanout for s in puller.subscribers] == [fanout if relayed else 0] * 2
    finally:
        puller.close()
