"""A model folder's safetensors files are checked from their headers before start (issue 49,
fault 6): a truncated file, a cut header, a missing shard, a bad dtype/shape byte count are
each refused naming the file, by ``rlflow train`` (exit 2, one line) and by the loader (a
:class:`ModelFormatError`, never a raw ``SafetensorError``). The ``safetensors`` library is
the oracle: every file refused here is refused by ``safe_open`` too, and the intact files
are read by it."""

import json
import os
import shutil
import struct

import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from rlflow.models.config import ModelFormatError
from rlflow.models.weight_files import INDEX_FILE, SINGLE_FILE, check_weight_files, read_header

TENSORS = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
           "b": np.ones((5,), np.int64), "c": np.zeros((2, 2), np.float16)}


def single(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    save_file(TENSORS, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    return folder


def sharded(tmp_path):
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"a": TENSORS["a"]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": TENSORS["b"], "c": TENSORS["c"]},
              str(folder / "model-00002-of-00002.safetensors"))
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    return folder


def library_refuses(fname) -> bool:
    try:
        with safe_open(str(fname), framework="numpy") as f:
            for k in f.keys():
                f.get_tensor(k)
    except (SafetensorError, OSError):
        return True
    return False


def test_intact_single_and_sharded_folders_pass_with_the_librarys_tensor_names(tmp_path):
    for folder in (single(tmp_path), sharded(tmp_path)):
        got = check_weight_files(str(folder))
        want = {}
        for fname in sorted(folder.glob("*.safetensors")):
            with safe_open(str(fname), framework="numpy") as f:
                want.update({k: str(fname) for k in f.keys()})
        assert got == want and sorted(got) == sorted(TENSORS)


def _rewrite_header(fname, edit):
    """Rewrite ``fname``'s JSON header through ``edit(header)`` (data bytes kept)."""
    raw = fname.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    body = json.dumps(header).encode()
    fname.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


def _cut(n_from_end):
    def damage(f):
        raw = f.read_bytes()
        f.write_bytes(raw[:len(raw) - n_from_end])
    return damage


def _header_cut(f):
    raw = f.read_bytes()
    f.write_bytes(raw[:20])                       # inside the JSON header


def _shape(h):
    h["a"]["shape"] = [3, 5]                      # 15 floats in a 12-float span


def _dtype(h):
    h["c"]["dtype"] = "F32"                       # 4 floats of 4 bytes in an 8-byte span


def _unknown_dtype(h):
    h["b"]["dtype"] = "X9"


@pytest.mark.parametrize("damage, what", [
    (_cut(1), "ends at byte"),
    (_cut(30), "ends at byte"),
    (_header_cut, "header length"),
    (lambda f: f.write_bytes(b"\x01\x02"), "too short for the header length"),
    (lambda f: f.write_bytes(struct.pack("<Q", 4) + b"{no}" + b"\0" * 8), "not valid JSON"),
    (lambda f: _rewrite_header(f, _shape), "needs 60"),
    (lambda f: _rewrite_header(f, _dtype), "needs 16"),
    (lambda f: _rewrite_header(f, _unknown_dtype), "dtype 'X9'"),
    (lambda f: f.write_bytes(f.read_bytes() + b"\0" * 4), "end together"),
])
def test_a_damaged_weight_file_is_refused_naming_it(tmp_path, damage, what):
    folder = single(tmp_path)
    fname = folder / SINGLE_FILE
    damage(fname)
    with pytest.raises(ModelFormatError) as e:
        check_weight_files(str(folder))
    msg = str(e.value)
    assert msg.startswith(f"{fname}: ") and what in msg and "(expected" in msg, msg
    assert library_refuses(fname)                  # the library agrees the file is bad


def test_a_truncated_or_missing_shard_of_a_sharded_folder_is_named(tmp_path):
    folder = sharded(tmp_path)
    second = folder / "model-00002-of-00002.safetensors"
    _cut(3)(second)
    with pytest.raises(ModelFormatError, match=f"^{second}: tensor '(b|c)' ends at byte"):
        check_weight_files(str(folder))
    second.unlink()
    with pytest.raises(ModelFormatError, match=rf"^{second}: missing \(expected: "
                                               rf"{INDEX_FILE} lists it for 2 tensors\)"):
        check_weight_files(str(folder))
    (folder / INDEX_FILE).write_text("{not json")
    with pytest.raises(ModelFormatError, match=rf"{INDEX_FILE}: not a JSON object"):
        check_weight_files(str(folder))


def test_a_tensor_the_index_lists_but_no_shard_holds_is_named(tmp_path):
    """A new user's report: the index maps ``d`` to a shard whose header lacks it; the
    pre-start check passed it and both programs then died in the loader."""
    from rlflow.config import ConfigError
    from rlflow.console.file_checks import check_model_weights

    folder = sharded(tmp_path)
    second = folder / "model-00002-of-00002.safetensors"
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"].update({"d": second.name, "e": second.name})
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with safe_open(str(second), framework="numpy") as f:       # the library's view
        assert "d" not in f.keys() and "e" not in f.keys()
    with pytest.raises(ModelFormatError, match=rf"^{second}: has no tensor 'd' \(expected: "
                                               rf"{INDEX_FILE} maps it to this file; 2 listed "
                                               rf"tensors are in no shard: \['d', 'e'\]\)"):
        check_weight_files(str(folder))
    with pytest.raises(ConfigError, match=rf"^model\.path: {second}: has no tensor 'd'"):
        check_model_weights(str(folder))
    # a stale index that puts a tensor in the other listed shard is not refused: the
    # tensor is taken from the shard whose header holds it
    first = "model-00001-of-00002.safetensors"
    index["weight_map"] = {"a": second.name, "b": first, "c": second.name}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    assert check_weight_files(str(folder)) == {"a": str(folder / first), "b": str(second),
                                               "c": str(second)}


def test_only_headers_are_read(tmp_path, monkeypatch):
    """The check reads 8 bytes + the header of each file, never the tensor data."""
    import builtins

    folder = single(tmp_path)
    fname = str(folder / SINGLE_FILE)
    header_len = struct.unpack("<Q", open(fname, "rb").read(8))[0]
    read = []
    real_open = builtins.open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            out = self.f.read(n)
            read.append(len(out))
            return out

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    def counting_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return Counting(f) if path == fname else f

    monkeypatch.setattr(builtins, "open", counting_open)
    read_header(fname)
    assert sum(read) == 8 + header_len < os.path.getsize(fname)


# ------------------------------------------------------------------ CLI and loader

@pytest.fixture
def damaged_demo_folder(tmp_path):
    """A copy of the demo model folder (tokenizer included) with its weights cut short."""
    from rlflow.config import load_config_file

    src = load_config_file(os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                        "demo.py")).model.path
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    _cut(100)(folder / SINGLE_FILE)
    return folder


def test_rlflow_train_refuses_a_truncated_model_in_one_line_exit_2(damaged_demo_folder,
                                                                    monkeypatch, capsys):
    import rlflow.launcher.supervisor
    from rlflow.console import cli

    monkeypatch.setattr(rlflow.launcher.supervisor, "run_train",
                        lambda cfg: pytest.fail("rlflow train started the programs"))
    monkeypatch.chdir(damaged_demo_folder.parent)
    code = cli.main(["train", "--run-dir", "runs", "--model.path", str(damaged_demo_folder)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    fname = damaged_demo_folder / SINGLE_FILE
    assert lines[0].startswith(f"rlflow train: model.path: {fname}: tensor "), err
    assert "truncated" in lines[0] and "(expected" in lines[0] and "Traceback" not in err


def test_rlflow_eval_and_the_loader_name_the_damaged_file(damaged_demo_folder, capsys,
                                                          monkeypatch):
    from rlflow.console import cli
    from rlflow.models import hf

    fname = damaged_demo_folder / SINGLE_FILE
    assert cli.main(["eval", "--model-path", str(damaged_demo_folder)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"rlflow eval: {fname}: tensor "), err  # after
    assert "SafetensorError" not in err                                          # the phases
    # damaged after the check (here: the check left out): the read itself names the file
    monkeypatch.setattr(hf, "check_weight_files", lambda path: _names_without_check(fname))
    with pytest.raises(ModelFormatError) as e:
        hf.load_hf(str(damaged_demo_folder))
    assert str(e.value).startswith(f"{fname}: cannot read tensor ") and "(expected" in str(e.value)


def _names_without_check(fname):
    """The header's tensor names, read without any size check."""
    with open(fname, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: str(fname) for k in header}


def test_the_launcher_reports_a_damaged_weight_file_as_bad_input():
    """A program that dies on a ModelFormatError (a file damaged after the pre-start check)
    is reported in one line without the traceback, like other bad input."""
    from rlflow.launcher.child_logs import is_input_error

    assert is_input_error("rlflow.models.config.ModelFormatError: /m/model.safetensors: "
                          "tensor 'a' ends at byte 48 of the data ...")
    assert not is_input_error("safetensors_rust.SafetensorError: incomplete metadata")
