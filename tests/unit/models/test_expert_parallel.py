"""Expert parallelism (issue 40 item 2): the ``expert`` mesh axis. The dropless experts of
one shard (:func:`rlflow.models.moe.dispatch` with ``first_expert``) equal a plain numpy
mixture of SwiGLU experts over the pairs routed to that shard; split over expert=4, fsdp x expert,
data x expert and expert x tensor meshes of fake CPU devices (tokens that do not divide the
token shards are padded) the output and its gradients (tokens, gates, every expert weight)
equal the one-device result; an expert count the axis does not divide is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.config import MeshConfig
from rlflow.mesh import logical_sharding, make_mesh
from rlflow.models.expert_parallel import DOWN_AXES, GATE_UP_AXES, expert_ffn
from rlflow.models.moe import dispatch
from tolerances import sum_tol

N, E, F, X, K = 10, 8, 12, 8, 2          # 10 tokens: padded to 12 on 4 token shards
MESHES = {"expert4": MeshConfig(expert=4), "fsdp2_expert2": MeshConfig(fsdp=2, expert=2),
          "data2_expert2": MeshConfig(data=2, expert=2),
          "expert2_tensor2": MeshConfig(expert=2, tensor=2)}


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, E)).astype(np.float32)
    ids = np.argsort(-rng.normal(size=(N, X)), axis=1)[:, :K].astype(np.int32)
    ids[0] = [X - 1, 0]                       # the first and last expert, both shard ends
    gates = rng.random((N, K)).astype(np.float32)
    wg, wu = (0.3 * rng.normal(size=(X, E, F)).astype(np.float32) for _ in range(2))
    wd = 0.3 * rng.normal(size=(X, F, E)).astype(np.float32)
    cot = np.cos(np.arange(N * E, dtype=np.float32)).reshape(N, E)
    args = tuple(jnp.asarray(a) for a in (x, ids, gates, wg, wu, wd))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(dispatch(*a) * cot),
                             argnums=(0, 2, 3, 4, 5)))(*args)
    return args, cot, grads


def _numpy_moe(x, ids, gates, wg, wu, wd):
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g, u = x[t] @ wg[e].astype(np.float64), x[t] @ wu[e].astype(np.float64)
            out[t] += gates[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return out


def _bound(x, wg, wu, wd):
    """A token's output passes through reductions over E (gate, up), F (down) and k; its
    terms are at most ``k x F x (E |x| |w_gate|) (E |x| |w_up|) |w_down|`` (gates <= 1)."""
    m = lambda a: float(np.abs(np.asarray(a)).max())  # noqa: E731
    scale = K * F * (E * m(x)) ** 2 * m(wg) * m(wu) * m(wd)
    return sum_tol(E + F + K, scale)


def test_dispatch_of_all_or_one_shards_experts_equals_a_numpy_mixture(case):
    (x, ids, gates, wg, wu, wd), _, _ = case
    want = _numpy_moe(*(np.asarray(a) for a in (x, ids, gates, wg, wu, wd)))
    got = np.asarray(jax.jit(dispatch)(x, ids, gates, wg, wu, wd))
    np.testing.assert_allclose(got, want, rtol=0, atol=_bound(x, wg, wu, wd))
    # the experts of one shard only: tokens routed elsewhere get nothing from it
    half = np.asarray(jax.jit(dispatch)(x, ids, gates, wg[4:], wu[4:], wd[4:], 4))
    only = np.where(np.asarray(ids) >= 4, np.asarray(ids), -1)
    want_half = np.zeros_like(want)
    for t in range(N):
        for j in range(K):
            if only[t, j] >= 0:
                want_half[t] += _numpy_moe(np.asarray(x)[t:t + 1], np.asarray(ids)[t:t + 1, j:j + 1],
                                           np.asarray(gates)[t:t + 1, j:j + 1],
                                           *(np.asarray(w) for w in (wg, wu, wd)))[0]
    np.testing.assert_allclose(half, want_half, rtol=0, atol=_bound(x, wg, wu, wd))
    assert np.abs(want_half).max() > 0 and np.abs(want - want_half).max() > 0


@pytest.mark.parametrize("name", list(MESHES))
def test_split_experts_equal_one_device(case, name):
    (x, ids, gates, wg, wu, wd), cot, grads = case
    cfg = MESHES[name]
    mesh = make_mesh(cfg, jax.devices()[:cfg.num_devices])
    put = lambda a, axes: jax.device_put(a, logical_sharding(mesh, axes, a.shape))  # noqa: E731
    args = (x, ids, gates, put(wg, GATE_UP_AXES), put(wu, GATE_UP_AXES), put(wd, DOWN_AXES))
    assert args[3].sharding.spec[0] == "expert"

    def f(*a):
        return expert_ffn(*a, mesh=mesh, experts_fn=dispatch)

    got = jax.jit(f)(*args)
    got_grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 2, 3, 4, 5)))(*args)
    one = jax.jit(dispatch)(x, ids, gates, wg, wu, wd)
    bound = _bound(x, wg, wu, wd)
    np.testing.assert_allclose(got, one, rtol=0, atol=2 * bound)
    for a, b, what in zip(got_grads, grads, ("x", "gates", "w_gate", "w_up", "w_down")):
        # each gradient entry sums the token outputs' cotangents (|cos| <= 1) over N tokens
        np.testing.assert_allclose(a, b, rtol=0, atol=2 * N * bound + sum_tol(N, float(
            np.abs(b).max())), err_msg=what)
        assert float(jnp.abs(b).max()) > 0, what


def test_an_expert_count_the_axis_does_not_divide_is_refused(case):
    (x, ids, gates, wg, wu, wd), _, _ = case
    mesh = make_mesh(MeshConfig(expert=4))
    with pytest.raises(ValueError, match=r"6 experts do not split over mesh\.expert=4"):
        expert_ffn(x, ids % 6, gates, wg[:6], wu[:6], wd[:6], mesh=mesh,
                   experts_fn=dispatch)
