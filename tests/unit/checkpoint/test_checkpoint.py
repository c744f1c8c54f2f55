"""Checkpoints (rlflow/checkpoint/): items round-trip, retention, re-sharding, exact resume,
and a save killed by SIGKILL. Runs on the 4 fake CPU devices of tests/conftest.py."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rlflow.checkpoint import (CheckpointError, Checkpointer, LearnerCheckpoint, abstract_target,
                               checkpoint_dir, restore_params, resume, run_metadata)
from rlflow.config import CheckpointConfig, ExperimentConfig
from checkpoint_fixtures import restore_on_another_mesh
from tolerances import F32_EPS

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 8, rngs=rngs)
        self.proj = nnx.Linear(8, 8, rngs=rngs)


def _tiny_params_and_opt():
    params = nnx.state(Tiny(nnx.Rngs(0)), nnx.Param)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_all_items_round_trip(tmp_path):
    params, opt_state = _tiny_params_and_opt()
    rngs = {"sample": jax.random.key(7), "dropout": jax.random.PRNGKey(3),
            "many": jax.random.split(jax.random.key(1), 3)}
    cfg = ExperimentConfig()
    ckpt = LearnerCheckpoint(step=5, params=params, opt_state=opt_state, rngs=rngs,
                             data_state={"next_index": 11}, policy_version=4,
                             extra={"epoch": 1}, metadata=run_metadata(cfg, note="x"))
    with Checkpointer(str(tmp_path / "ck"), CheckpointConfig()) as ck:
        assert ck.save(ckpt, force=True)
        ck.wait()
        assert ck.latest_step() == 5
        got = ck.restore(params_target=params, opt_state_target=opt_state)
    assert (got.step, got.policy_version, got.extra) == (5, 4, {"epoch": 1})
    assert got.data_state == {"next_index": 11}
    assert got.metadata["config"]["learner"]["lr"] == cfg.learner.lr
    assert got.metadata["note"] == "x" and got.metadata["versions"]["orbax-checkpoint"]
    assert isinstance(got.params, nnx.State)
    _leaves_equal(got.params, params)
    _leaves_equal(got.opt_state, opt_state)
    assert int(got.opt_state[1][0].count) == 1
    # typed keys come back typed with the same impl; raw keys come back raw
    assert jax.random.key_impl(got.rngs["sample"]) == jax.random.key_impl(rngs["sample"])
    np.testing.assert_array_equal(jax.random.key_data(got.rngs["sample"]),
                                  jax.random.key_data(rngs["sample"]))
    np.testing.assert_array_equal(jax.random.key_data(got.rngs["many"]),
                                  jax.random.key_data(rngs["many"]))
    assert got.rngs["dropout"].dtype == jnp.uint32
    np.testing.assert_array_equal(got.rngs["dropout"], rngs["dropout"])
    # export path: parameters only, no target -> host numpy arrays in a nested dict
    step, host_params, meta = restore_params(str(tmp_path / "ck"))
    assert step == 5 and meta["note"] == "x"
    assert isinstance(host_params["proj"]["kernel"]["value"], np.ndarray)
    np.testing.assert_array_equal(host_params["proj"]["kernel"]["value"], params["proj"]["kernel"][...])


def test_bytes_iterator_state_and_no_opt_state(tmp_path):
    params, _ = _tiny_params_and_opt()
    blob = b'{"workers": [1, 2]}\x00\xff'
    with Checkpointer(str(tmp_path), async_save=False) as ck:
        ck.save(LearnerCheckpoint(step=1, params=params, data_state=blob), force=True)
        got = ck.restore(params_target=params)
    assert got.data_state == blob and got.opt_state is None


def test_every_steps_and_save_at_exit(tmp_path):
    params, _ = _tiny_params_and_opt()
    with Checkpointer(str(tmp_path), CheckpointConfig(every_steps=2, keep_last=10)) as ck:
        saved = [ck.save(LearnerCheckpoint(step=s, params=params)) for s in range(1, 6)]
        assert saved == [False, True, False, True, False]
        assert ck.save_final(LearnerCheckpoint(step=5, params=params))
        assert not ck.save_final(LearnerCheckpoint(step=5, params=params))  # already there
        assert ck.all_steps() == [2, 4, 5]


@pytest.mark.parametrize("mode,values,best", [
    ("max", [0.1, 0.9, 0.3, float("nan"), 0.2, 0.4], 2),
    ("min", [0.5, 0.9, 0.05, 0.3, 0.2, 0.4], 3),
])
def test_keep_last_and_keep_best(tmp_path, mode, values, best):
    params, _ = _tiny_params_and_opt()
    cfg = CheckpointConfig(keep_last=2, keep_best_metric="m", keep_best_mode=mode)
    with Checkpointer(str(tmp_path), cfg) as ck:
        for step, v in enumerate(values, start=1):
            ck.save(LearnerCheckpoint(step=step, params=params), metrics={"m": v, "other": 1.0},
                    force=True)
        ck.wait()
        assert ck.all_steps() == sorted({best, 5, 6})
        assert ck.best_step() == best
        with pytest.raises(CheckpointError, match="keep_best_metric='m'"):
            ck.save(LearnerCheckpoint(step=7, params=params), metrics={"loss": 1.0}, force=True)
    # a reopened folder knows the same steps and the same best
    with Checkpointer(str(tmp_path), cfg) as ck:
        assert ck.best_step() == best and ck.all_steps() == sorted({best, 5, 6})


def test_errors_name_what_is_wrong(tmp_path):
    params, _ = _tiny_params_and_opt()
    with Checkpointer(str(tmp_path / "ck")) as ck:
        assert resume(ck, params_target=params) is None          # empty folder: fresh start
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            ck.restore(params_target=params)
        ck.save_final(LearnerCheckpoint(step=3, params=params))
        with pytest.raises(CheckpointError, match=r"step 4 .*available steps: \[3\]"):
            ck.restore(4, params_target=params)
        wrong = jax.tree.map(lambda x: jnp.zeros(x.shape + (1,), x.dtype), params)
        with pytest.raises(CheckpointError, match=r"embed/embedding/value: saved shape \(32, 8\)"):
            ck.restore(params_target=wrong)
        with pytest.raises(CheckpointError, match="rngs\\['r'\\].*uint32"):
            ck.save(LearnerCheckpoint(step=4, params=params, rngs={"r": jnp.zeros(2)}), force=True)
        with pytest.raises(CheckpointError, match="data_state"):
            ck.save(LearnerCheckpoint(step=4, params=params, data_state={"x": object()}),
                    force=True)
    with Checkpointer(str(tmp_path / "ck"), CheckpointConfig(resume="never")) as ck:
        assert resume(ck, params_target=params) is None
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        restore_params(str(tmp_path / "missing"))
    assert checkpoint_dir("runs/x").endswith(os.path.join("runs", "x", "checkpoints"))


def test_a_checkpoint_damaged_on_disk_names_its_folder_and_the_way_out(tmp_path):
    """The array files of a committed checkpoint emptied: restore raises
    DamagedCheckpointError naming the step folder and the underlying read error (one line,
    not tensorstore's spec), which the launcher shows as the failure's one line."""
    from rlflow.checkpoint.state import DamagedCheckpointError
    from rlflow.launcher.child_logs import is_input_error

    params, _ = _tiny_params_and_opt()
    for earlier in ([], [1]):
        ckdir = str(tmp_path / f"ck{len(earlier)}")
        with Checkpointer(ckdir, CheckpointConfig(keep_last=5), async_save=False) as ck:
            for step in earlier + [2]:
                ck.save(LearnerCheckpoint(step=step, params=params), force=True)
        files = [f for f in glob.glob(f"{ckdir}/2/params/**/d/*", recursive=True)
                 if os.path.isfile(f)]
        assert files
        for f in files:
            open(f, "wb").close()
        with Checkpointer(ckdir) as ck:
            with pytest.raises(DamagedCheckpointError) as err:
                ck.restore(params_target=params)
            if earlier:                                   # the advice holds: step 1 restores
                _leaves_equal(ck.restore(1, params_target=params).params, params)
        text = str(err.value)
        assert text.startswith(f"{ckdir}/2: checkpoint step 2 cannot be read (")
        assert f"mv {ckdir}/2 {ckdir}.damaged-2" in text and "\n" not in text
        assert ("to resume from step 1, the checkpoint before it" in text) == bool(earlier)
        assert ("there is no earlier checkpoint" in text) != bool(earlier)
        # one short line: bounded apart from the folder path it names (a few times; the
        # path's length depends on where pytest puts tmp_path, e.g. under an xdist worker)
        assert len(text.replace(ckdir, "")) < 700
        assert isinstance(err.value, CheckpointError)
        assert is_input_error(f"rlflow.checkpoint.state.DamagedCheckpointError: {text}")


# --- restore onto a different mesh ---------------------------------------------------------------

def _toy_logits(p, tokens):
    """A two-layer toy decoder body: embed -> tanh MLP -> unembed ([B, T] -> [B, T, V])."""
    h = p["embed"][tokens]
    h = h + jnp.tanh(h @ p["w1"]) @ p["w2"]
    return h @ p["unembed"]


def _toy_logits_np(p, tokens):
    h = p["embed"][tokens]
    h = h + np.tanh(h @ p["w1"]) @ p["w2"]
    return h @ p["unembed"]


def test_restore_onto_a_different_mesh_gives_same_logits(tmp_path):
    devs = np.array(jax.devices()[:4])
    mesh_a = jax.sharding.Mesh(devs.reshape(1, 4, 1), ("data", "fsdp", "tensor"))
    mesh_b = jax.sharding.Mesh(devs.reshape(1, 2, 2), ("data", "fsdp", "tensor"))
    rng = np.random.default_rng(0)
    host = {"embed": rng.normal(size=(64, 16)), "w1": rng.normal(size=(16, 32)) / 4,
            "w2": rng.normal(size=(32, 16)) / 4, "unembed": rng.normal(size=(16, 64))}
    host = {k: v.astype(np.float32) for k, v in host.items()}
    specs_a = {"embed": P("fsdp", None), "w1": P("fsdp", None), "w2": P(None, "fsdp"),
               "unembed": P("fsdp", None)}
    specs_b = {"embed": P("fsdp", "tensor"), "w1": P("fsdp", "tensor"),
               "w2": P("tensor", "fsdp"), "unembed": P("fsdp", "tensor")}
    sh_a = {k: NamedSharding(mesh_a, s) for k, s in specs_a.items()}
    sh_b = {k: NamedSharding(mesh_b, s) for k, s in specs_b.items()}
    params_a = jax.device_put(host, sh_a)
    opt = optax.adam(1e-3)
    opt_a = jax.jit(opt.init)(params_a)
    tokens = jnp.asarray(rng.integers(0, 64, size=(2, 5)), jnp.int32)
    logits_a = jax.jit(_toy_logits)(params_a, tokens)

    with Checkpointer(str(tmp_path)) as ck:
        ck.save_final(LearnerCheckpoint(step=1, params=params_a, opt_state=opt_a))
    opt_target = abstract_target(
        jax.eval_shape(opt.init, host),
        optax.tree_map_params(opt, lambda _, s: s, jax.eval_shape(opt.init, host), sh_b,
                              transform_non_params=lambda _: NamedSharding(mesh_b, P())))
    with Checkpointer(str(tmp_path)) as ck:
        got = ck.restore(params_target=abstract_target(host, sh_b), opt_state_target=opt_target)
    for k in host:
        assert got.params[k].sharding == sh_b[k], k
        np.testing.assert_array_equal(np.asarray(got.params[k]), host[k])
        assert got.opt_state[0].mu[k].sharding == sh_b[k]
    logits_b = jax.jit(_toy_logits)(got.params, tokens)
    # same values on another mesh, numpy as a third program: the toy's reductions (embed dim
    # twice, MLP width once) times eps times the logits' scale (tests/tolerances.py)
    e, h = host["w1"].shape
    atol = 2 * (2 * e + h) * F32_EPS * float(np.abs(np.asarray(logits_a)).max())
    np.testing.assert_allclose(np.asarray(logits_b), np.asarray(logits_a), rtol=0, atol=atol)
    np.testing.assert_allclose(np.asarray(logits_b), _toy_logits_np(host, np.asarray(tokens)),
                               rtol=0, atol=atol)


def test_decoder_saved_on_fsdp4_restores_on_fsdp2_tensor2_with_same_logits(tmp_path):
    """The real decoder and rlflow.mesh's shardings: fsdp=4 -> (fsdp=2, tensor=2)."""
    from rlflow.config import MeshConfig, ModelConfig
    from rlflow.mesh import make_mesh

    devs = jax.devices()[:4]
    mesh_a = make_mesh(MeshConfig(fsdp=4), devs)
    mesh_b = make_mesh(MeshConfig(fsdp=2, tensor=2), devs)
    model_cfg = ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=32,
                            intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, tie_word_embeddings=False, init_seed=3)
    _, params_b, logits, ref, atol = restore_on_another_mesh(tmp_path, model_cfg, mesh_a, mesh_b)
    specs_b = {str(x.sharding.spec) for x in jax.tree.leaves(params_b)}
    assert all(x.sharding.mesh.shape == mesh_b.shape for x in jax.tree.leaves(params_b))
    assert any("tensor" in s for s in specs_b)                 # really re-laid, not copied
    np.testing.assert_allclose(np.asarray(logits(params_b)), ref, rtol=0, atol=atol)


# --- exact resume ---------------------------------------------------------------------------------

N_PROMPTS, BATCH, EPOCHS = 6, 2, 2
STEPS = N_PROMPTS // BATCH * EPOCHS


def _learner_config():
    from rlflow.config import LearnerConfig
    return LearnerConfig(lr=0.1, warmup_steps=2, num_steps=STEPS, schedule="cosine",
                         max_grad_norm=1.0, weight_decay=0.01)


def _schedule():
    from rlflow.learner.optimizer import lr_schedule
    return lr_schedule(_learner_config())      # the learner's own schedule and optimiser


def _optimizer():
    from rlflow.learner.optimizer import make_optimizer
    return make_optimizer(_learner_config())[0]


def _count(opt_state) -> int:
    """The optimiser's update count (Adam's and the schedule's, which must agree)."""
    counts = {int(c) for _, c in optax.tree_utils.tree_get_all_with_path(opt_state, "count")}
    assert len(counts) == 1, counts
    return counts.pop()


def _prompt_iter():
    """6 prompts, batch 2, 2 epochs, reshuffled per epoch with a fixed seed (grain)."""
    ds = grain.MapDataset.source(list(range(N_PROMPTS))).shuffle(seed=42).repeat(EPOCHS)
    return iter(ds.batch(BATCH).to_iter_dataset())


@jax.jit
def _train_step(params, opt_state, key, batch):
    key, noise_key = jax.random.split(key)

    def loss_fn(p):
        x = p["embed"][batch] + 0.01 * jax.random.normal(noise_key, (batch.shape[0], 4))
        return jnp.mean((x @ p["w"] - batch[:, None].astype(jnp.float32) / N_PROMPTS) ** 2)

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = _optimizer().update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, key


def _init():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"embed": jax.random.normal(k1, (N_PROMPTS, 4)), "w": jax.random.normal(k2, (4, 3))}
    return params, _optimizer().init(params), jax.random.key(123)


def _run(folder, stop_after=None):
    """The shape of the learner loop: resume if possible, train, save every step and at exit."""
    params, opt_state, key = _init()
    it = _prompt_iter()
    log = {"batches": [], "lr": {}, "count_after_restore": None}
    with Checkpointer(folder, CheckpointConfig(every_steps=1, keep_last=2)) as ck:
        start = 0
        restored = resume(ck, params_target=params, opt_state_target=opt_state)
        if restored is not None:
            params, opt_state, key = restored.params, restored.opt_state, restored.rngs["train"]
            it.set_state(restored.data_state)
            start = restored.step
            log["count_after_restore"] = _count(opt_state)
        for step in range(start + 1, STEPS + 1):
            batch = next(it)
            log["batches"].append((step, batch.tolist()))
            log["lr"][step] = float(_schedule()(_count(opt_state)))
            params, opt_state, key = _train_step(params, opt_state, key, jnp.asarray(batch))
            ckpt = LearnerCheckpoint(step=step, params=params, opt_state=opt_state,
                                     rngs={"train": key}, data_state=it.get_state())
            ck.save(ckpt)
            if step == stop_after:
                ck.save_final(ckpt)
                return params, opt_state, log
    return params, opt_state, log


@pytest.mark.parametrize("stop_after", [3, 2], ids=["epoch-boundary", "mid-epoch"])
def test_exact_resume(tmp_path, stop_after):
    ref_params, ref_opt, ref_log = _run(str(tmp_path / "ref"))
    _, _, first = _run(str(tmp_path / "run"), stop_after=stop_after)
    params, opt_state, second = _run(str(tmp_path / "run"))
    # the batches: no batch repeated or skipped, epoch 2 in the uninterrupted order
    assert first["batches"] + second["batches"] == ref_log["batches"]
    assert sorted(sum((b for _, b in ref_log["batches"][:3]), [])) == list(range(N_PROMPTS))
    assert second["count_after_restore"] == stop_after
    assert _count(opt_state) == STEPS == _count(ref_opt)
    assert second["lr"][stop_after + 1] == ref_log["lr"][stop_after + 1]
    _leaves_equal(params, ref_params)        # bit-identical on CPU
    _leaves_equal(opt_state, ref_opt)


# --- SIGKILL during a save -------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from orbax.checkpoint._src.path import atomicity
    from rlflow.checkpoint import Checkpointer, LearnerCheckpoint
    folder, marker = sys.argv[1], sys.argv[2]
    params = {"w": np.full((256, 256), 1.0, np.float32)}
    ck = Checkpointer(folder)
    ck.save_final(LearnerCheckpoint(step=1, params=params))
    original = atomicity.AtomicRenameTemporaryPath.finalize
    async def slow_finalize(self):
        # the arrays of step 2 are written; hold the commit so the parent kills us here
        open(marker, "w").close()
        time.sleep(120)
        await original(self)
    atomicity.AtomicRenameTemporaryPath.finalize = slow_finalize
    ck.save(LearnerCheckpoint(step=2, params={"w": params["w"] * 2}), force=True)
    time.sleep(120)
""")


def test_sigkill_during_save_keeps_last_complete_checkpoint(tmp_path):
    folder, marker = str(tmp_path / "ck"), str(tmp_path / "finalizing")
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, folder, marker], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            if proc.poll() is not None:
                pytest.fail(f"child exited early:\n{proc.stdout.read().decode()[-3000:]}")
            assert time.monotonic() < deadline, "child never reached the commit of step 2"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    leftovers = glob.glob(os.path.join(folder, "2.orbax-checkpoint-tmp*"))
    assert leftovers, os.listdir(folder)                    # killed in the middle of step 2
    params = {"w": np.zeros((256, 256), np.float32)}
    with Checkpointer(folder) as ck:
        assert ck.latest_step() == 1 and ck.all_steps() == [1]
        got = resume(ck, params_target=params)
        assert got.step == 1
        np.testing.assert_array_equal(np.asarray(got.params["w"]), 1.0)
        ck.save_final(LearnerCheckpoint(step=2, params={"w": np.full((256, 256), 2.0, np.float32)}))
        assert not glob.glob(os.path.join(folder, "*tmp*"))  # the partial save was cleaned up
    with Checkpointer(folder) as ck:
        assert ck.all_steps() == [1, 2]
        np.testing.assert_array_equal(np.asarray(ck.restore(params_target=params).params["w"]), 2.0)
