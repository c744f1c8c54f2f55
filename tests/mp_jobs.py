"""Functions run in every process of a rlflow.launcher.local_hosts group (``fn(ctx) -> result``)."""

import jax
import numpy as np

from rlflow.config import MeshConfig, ModelConfig
from learner_fixtures import make_group_records, tiny_experiment

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
LR, STEPS = 1e-4, 3
# pytest-timeout of a test using conftest's two_learner_hosts: the shared run's set-up (~8
# min on a busy 2-core host) counts against the first such test; a hang guard, not a speed check.
SHARED_RUN_TIMEOUT_S = 1800


def experiment(**learner):
    """fsdp=2 x tensor=2 over 4 devices, 2 micro-batches, KL to the reference."""
    base = dict(num_devices=4, mesh=MeshConfig(fsdp=2, tensor=2), micro_batches=2,
                kl_coef=0.5, lr=LR)
    return tiny_experiment(MODEL, G, T, **{**base, **learner})


def one_host_two_devices():
    """The same learner on 1 host x 2 devices (fsdp=2) of the calling process."""
    from rlflow.learner.trainer import Learner

    return Learner(experiment(num_devices=2, mesh=MeshConfig(fsdp=2)),
                   devices=jax.devices()[:2])


def step_records(step):
    return make_group_records(100 + step, 2, vocab=VOCAB, group_size=G, max_tokens=T)


LOGIT_TOKENS = np.random.default_rng(5).integers(1, VOCAB, size=(4, 12)).astype(np.int32)


def logits(learner):
    """Logits of LOGIT_TOKENS (float32 [4, 12, VOCAB]) as numpy on every host; the tokens are
    constants of the jitted function, so no host input crosses processes."""
    from flax import nnx

    from rlflow.mesh import replicated

    tokens = LOGIT_TOKENS
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    mask = np.ones(tokens.shape, bool)

    def fn(params):
        return nnx.merge(learner.graphdef, params)(tokens, pos, mask)

    return np.asarray(jax.jit(fn, out_shardings=replicated(learner.mesh))(learner.params))


def train_multihost(ctx):
    """Train STEPS steps with host 0 building each batch; every host returns the gathered
    parameters, metrics and batch-distribution info. Then (every host) save a checkpoint to
    ``args["ckpt_out"]`` and return its logits, restore ``args["restore_from"]`` (written by
    one host) onto this 2-host mesh and return those logits, and serve the trained
    parameters' shards to a sampler (:func:`serve_units`)."""
    from flax import nnx

    from rlflow.checkpoint import Checkpointer
    from rlflow.learner import multihost
    from rlflow.learner.trainer import Learner

    cfg = experiment()
    learner = Learner(cfg, mesh=multihost.global_mesh(cfg.learner.mesh))
    metrics, infos = [], []
    for step in range(STEPS):
        batch = learner.build_batch(step_records(step))[0] if jax.process_index() == 0 else None
        m, info = multihost.train_step(learner, batch)
        metrics.append(m)
        infos.append(info)
    params = {k: v for k, v in nnx.to_flat_state(multihost.gather_to_host(learner.params))}
    params = {k: np.asarray(v[...]) for k, v in params.items()}
    out = dict(params=params, metrics=metrics, infos=infos, version=learner.version,
               process_count=jax.process_count(), logits=logits(learner))
    with Checkpointer(ctx.args["ckpt_out"], async_save=False) as ck:
        ck.save(learner.checkpoint(), force=True)
    other = Learner(cfg, mesh=multihost.global_mesh(cfg.learner.mesh))
    with Checkpointer(ctx.args["restore_from"], read_only=True) as ck:
        restored = other.resume(ck)
    out.update(restored_step=restored.step, restored_version=other.version,
               restored_logits=logits(other), units=serve_units(ctx, learner))
    return out


def serve_units(ctx, learner):
    """Each learner host serves its own shards of ``learner``'s params (a WeightPublisher +
    coordinator per host, address written to ``coordinator_<i>.txt``) until the file
    ``done`` appears (the sampler pulled); returns this host's unit keys."""
    import os
    import time

    from rlflow.exchange.coordinator import Coordinator
    from rlflow.exchange.host_shards import host_units
    from rlflow.exchange.transfer import WeightPublisher

    units = host_units(learner.params)
    pub = WeightPublisher(pull_timeout_s=600)
    coord = Coordinator(pub).start()
    pub.publish(learner.version, units)
    path = os.path.join(ctx.work_dir, f"coordinator_{ctx.process_id}.txt")
    with open(path + ".tmp", "w") as f:
        f.write(coord.address)
    os.replace(path + ".tmp", path)
    done = os.path.join(ctx.work_dir, "done")
    deadline = time.monotonic() + 600
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.2)
    coord.close()
    return sorted(units)


def collectives_until_killed(ctx):
    """Every host: a broadcast every 0.2 s for up to 10 minutes; ``ready_<i>`` after the
    first one (the test then kills a host)."""
    import os
    import time

    from jax.experimental import multihost_utils

    for n in range(3000):
        multihost_utils.broadcast_one_to_all(np.arange(4, dtype=np.int32) + n)
        if n == 0:
            open(os.path.join(ctx.work_dir, f"ready_{ctx.process_id}"), "w").close()
        time.sleep(0.2)
    return "not killed"


def sharded_sum_twice(ctx):
    """A sum over 4 devices of 2 processes, jitted twice as two function objects (the second
    compile may be a persistent-cache hit): both results, on every host."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("a", "b")))
    outs = []
    for _ in range(2):
        def total(v):
            return jnp.sum(v * v)
        outs.append(float(np.asarray(jax.jit(total, out_shardings=NamedSharding(mesh, P()))(x))))
    return dict(outs=outs, cache=bool(jax.config.jax_enable_compilation_cache),
                **commands_from_two_call_sites(ctx))


def commands_from_two_call_sites(ctx):
    """The learner hosts' command exchange as ``rlflow train`` runs it: host 0 sends from
    ``HostCommands.send``, the others receive in ``HostCommands.receive`` (one
    ``broadcast_one_to_all`` reached from two source lines; it hung on jax 0.12.1 while the
    call stack was part of the lowered program), twice; then every host's address."""
    from rlflow.learner.hosts import STEP, PUBLISH, HostCommands, gather_addresses

    commands = HostCommands()
    got = []
    for op, arg in ((PUBLISH, 7), (STEP, 0)):
        if commands.leader:
            commands.send(op, arg)
            got.append([op, arg])
        else:
            got.append(list(commands.receive()))
    address = "" if commands.leader else f"host{ctx.process_id}:{1000 + ctx.process_id}"
    return dict(commands=got, addresses=gather_addresses(address),
                locations=jax.config.jax_traceback_in_locations_limit)
