"""Job and result files of rlflow.launcher.local_hosts children: JSON + .npz, no pickle.

Pure file tests (no child process); the real processes that use these files are those of
tests/e2e/test_multihost.py."""

import json
import math

import numpy as np
import pytest

from rlflow.launcher.local_host_files import (HostFileError, Job, job_path, read_job, read_value,
                                             result_path, write_job, write_value)


def _tree():
    rng = np.random.default_rng(0)
    return {
        "params": {("layers", 0, "kernel"): rng.normal(size=(3, 4)).astype(np.float32),
                   ("embed",): rng.integers(0, 9, size=(5,)).astype(np.int32)},
        "metrics": [{"learner/loss": np.float32(0.25), "n": np.int64(7), "f": np.float64(2.5)},
                    {"nan": math.nan}],
        "version": 3, "ok": True, "none": None, "name": "x", "ratio": 0.5,
        "units": ("a", ("b", 1)), "mask": np.array([True, False]), "empty": np.zeros((0, 2)),
        "__dunder": [1, 2],
    }


def _assert_same(got, want, where="value"):
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, np.ndarray) or isinstance(want, np.generic):
        assert got.dtype == want.dtype and np.shape(got) == np.shape(want), where
        np.testing.assert_array_equal(got, want, err_msg=where)
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, where


def test_a_result_round_trips_with_types_dtypes_and_tuple_keys(tmp_path):
    path = result_path(tmp_path, 1)
    want = _tree()
    write_value(path, want)
    json.loads(path.read_text())                        # plain JSON (NaN aside)
    with np.load(path.with_suffix(".npz"), allow_pickle=False) as npz:
        assert len(npz.files) == 7                      # 4 arrays + 3 numpy scalars
    _assert_same(read_value(path), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result_1.json", "result_1.npz"]


def test_a_job_round_trips(tmp_path):
    job = Job(target="mp_jobs:train", num_processes=2, devices_per_process=2,
              work_dir=str(tmp_path), args={"ckpt": "/x", "n": 3}, distributed=True,
              coordinator="127.0.0.1:1234", init_timeout_s=300.0, heartbeat_timeout_s=100)
    assert write_job(tmp_path, job) == job_path(tmp_path)
    assert read_job(job_path(tmp_path)) == job


def test_unsaveable_values_are_refused_naming_the_field(tmp_path):
    with pytest.raises(HostFileError, match=r"result\['a'\]\[1\]: a set is not saved"):
        write_value(tmp_path / "r.json", {"a": [1, {2}]}, what="result")
    with pytest.raises(HostFileError, match=r"result\['o'\]: an object array"):
        write_value(tmp_path / "r.json", {"o": np.array([None, 1])}, what="result")


def _job_doc(tmp_path, **change):
    write_job(tmp_path, Job(target="m:f", num_processes=1, devices_per_process=1,
                            work_dir=str(tmp_path), args={}, distributed=False,
                            coordinator="127.0.0.1:1", init_timeout_s=1.0,
                            heartbeat_timeout_s=1.0))
    doc = json.loads(job_path(tmp_path).read_text())
    doc.update(change)
    for k in [k for k, v in change.items() if v is None]:
        del doc[k]
    job_path(tmp_path).write_text(json.dumps(doc))


@pytest.mark.parametrize("change, match", [
    (dict(num_processes=None), "field 'num_processes' is missing"),
    (dict(num_processes="2"), "field 'num_processes': expected int, got str"),
    (dict(distributed=1), "field 'distributed': expected bool, got int"),
    (dict(devices_per_process=True), "field 'devices_per_process': expected int, got bool"),
    (dict(target="no_colon"), "field 'target': expected 'module:function'"),
    (dict(extra=1), r"unknown field\(s\) \['extra'\]"),
])
def test_a_malformed_job_names_the_file_and_the_field(tmp_path, change, match):
    _job_doc(tmp_path, **change)
    with pytest.raises(HostFileError, match=match) as e:
        read_job(job_path(tmp_path))
    assert str(job_path(tmp_path)) in str(e.value)


def test_a_malformed_result_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "result_0.json"
    write_value(path, {"params": {"w": np.ones(2)}, "n": (1, 2)}, what="result")
    good = path.read_text()
    path.write_text(good[:-3])
    with pytest.raises(HostFileError, match=r"result_0\.json: line 1 column \d+: not JSON"):
        read_value(path)
    path.write_text(good.replace('"a0"', '"a9"'))
    with pytest.raises(HostFileError, match=r"result_0\.json: field result\['params'\]\['w'\]: "
                                            r"array 'a9' is not in .*result_0\.npz"):
        read_value(path, what="result")
    path.write_text(good.replace('{"__tuple__": [1, 2]}', '{"__tuple__": 5}'))
    with pytest.raises(HostFileError, match=r"field result\['n'\]: __tuple__ holds a int"):
        read_value(path, what="result")
    path.write_text(good)
    np.savez(path.with_suffix(".npz"), a0=np.array([None], dtype=object))   # pickled entry
    with pytest.raises(HostFileError, match=r"field result\['params'\]\['w'\]: array 'a0' of "
                                            r".*result_0\.npz cannot be read without pickle"):
        read_value(path, what="result")
    path.with_suffix(".npz").write_bytes(b"not a zip")
    with pytest.raises(HostFileError, match=r"result_0\.npz: cannot be read as \.npz"):
        read_value(path)
    path.with_suffix(".npz").unlink()
    with pytest.raises(HostFileError, match=r"result_0\.npz: cannot be read"):
        read_value(path)
