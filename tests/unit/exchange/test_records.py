"""Rollout group records: schema validation and binary framing (rlflow.exchange.records)."""

import json
import struct

import numpy as np
import pytest

from rlflow.exchange import records
from rlflow.exchange.records import FrameError, RecordError


def group(version=3, seed=0, **kw):
    return records.synthetic_group(np.random.default_rng(seed), version=version, **kw)


def assert_same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ------------------------------------------------------------------------------ framing


def test_frames_round_trip():
    g = group(group_size=3, max_tokens=7, prompt_len=5)
    frames = records.encode_frames(g)
    assert len(frames) == 1 + len(g)
    out = records.decode_frames([bytes(f) for f in frames])
    assert_same(g, out)
    assert records.validate_group(out) == {"P": 5, "G": 3, "T": 7}


def test_bytes_layout_matches_documented_format():
    g = group(group_size=2, max_tokens=4, prompt_len=3)
    buf = records.encode_bytes(g)
    # Independent reader of the documented layout: magic, uint32-LE length, JSON, raw bytes.
    assert buf[:4] == b"RLFA"
    (hlen,) = struct.unpack("<I", buf[4:8])
    header = json.loads(buf[8:8 + hlen])
    assert [f[0] for f in header["fields"]] == list(g)
    pos = 8 + hlen
    for name, dtype, shape in header["fields"]:
        want = np.asarray(g[name], dtype=np.dtype(dtype).newbyteorder("<"), order="C")
        assert list(want.shape) == shape
        assert buf[pos:pos + want.nbytes] == want.tobytes(), name
        pos += want.nbytes
    assert pos == len(buf)
    assert_same(g, records.decode_bytes(buf))


def test_big_endian_input_decodes_to_same_values():
    g = group()
    swapped = {k: v.astype(v.dtype.newbyteorder(">")) for k, v in g.items()}
    out = records.decode_bytes(records.encode_bytes(swapped))
    for k in g:
        np.testing.assert_array_equal(out[k], g[k])
        assert out[k].dtype.isnative


def test_object_dtype_cannot_travel():
    with pytest.raises(FrameError, match="'bad'.*object"):
        records.encode_frames({"bad": np.array([{"x": 1}], dtype=object)})


def _frames(header, *data):
    return [json.dumps(header).encode(), *data]


@pytest.mark.parametrize("frames, match", [
    ([b"\xff\xfe"], "not UTF-8 JSON"),
    (_frames({"format": "pickle"}), "format"),
    (_frames({"format": records.FORMAT, "fields": [["x", "object", [1]]]}, b"\0" * 8),
     "dtype 'object' not allowed"),
    (_frames({"format": records.FORMAT, "fields": [["x", "int32", [3]]]}, b"\0" * 8),
     "needs 12 bytes, got 8"),
    (_frames({"format": records.FORMAT, "fields": [["x", "int32", [2]]]}), "1 fields but 0"),
    (_frames({"format": records.FORMAT, "fields": [["x", "int32"]]}), "expected \\[name"),
    (_frames({"format": records.FORMAT, "fields": [["x", "int32", [-1]]]}, b""), "negative"),
])
def test_malformed_frames_raise_frame_error(frames, match):
    with pytest.raises(FrameError, match=match):
        records.decode_frames(frames)


def test_malformed_bytes_raise_frame_error():
    buf = records.encode_bytes(group())
    with pytest.raises(FrameError, match="magic"):
        records.decode_bytes(b"PKL!" + buf[4:])
    with pytest.raises(FrameError, match="truncated"):
        records.decode_bytes(buf[:-3])
    with pytest.raises(FrameError, match="trailing"):
        records.decode_bytes(buf + b"\0")
    with pytest.raises(FrameError, match="runs past"):
        records.decode_bytes(buf[:4] + struct.pack("<I", 10**6) + buf[8:20])


# ------------------------------------------------------------------------------ schema


@pytest.mark.parametrize("field", list(records.GROUP_SCHEMA))
def test_wrong_dtype_names_field_expected_and_got(field):
    g = group()
    wrong = np.float64 if g[field].dtype != np.float64 else np.int32
    g[field] = g[field].astype(wrong)
    with pytest.raises(RecordError) as e:
        records.validate_group(g)
    assert e.value.field == field
    assert e.value.expected == f"dtype {records.GROUP_SCHEMA[field][0]}"
    assert e.value.got == f"dtype {np.dtype(wrong)}"
    assert field in str(e.value)


@pytest.mark.parametrize("field", [f for f, (_, s) in records.GROUP_SCHEMA.items() if s])
def test_wrong_rank_names_field(field):
    g = group()
    g[field] = g[field][..., None]
    with pytest.raises(RecordError) as e:
        records.validate_group(g)
    assert e.value.field == field
    assert e.value.got == f"shape {list(g[field].shape)}"


def test_sizes_disagreeing_between_fields():
    g = group(group_size=4, max_tokens=6)
    g["rewards"] = g["rewards"][:3]
    with pytest.raises(RecordError) as e:
        records.validate_group(g)
    assert (e.value.field, e.value.got) == ("rewards", "shape [3]")
    assert "G=4" in e.value.expected
    g = group(group_size=4, max_tokens=6)
    g["policy_versions"] = g["policy_versions"][:, :5]
    with pytest.raises(RecordError, match="policy_versions"):
        records.validate_group(g)


def test_missing_extra_and_non_array_fields():
    g = group()
    del g["truncated"]
    with pytest.raises(RecordError) as e:
        records.validate_group(g)
    assert e.value.field == "truncated" and "missing" in e.value.got
    g = group()
    g["advantages"] = np.zeros(4, np.float32)
    with pytest.raises(RecordError, match="advantages"):
        records.validate_group(g)
    g = group()
    g["rewards"] = [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(RecordError, match="object of type list"):
        records.validate_group(g)
    with pytest.raises(RecordError, match="mapping"):
        records.validate_group([1, 2])


def test_value_checks():
    g = group(max_tokens=5)
    g["completion_lengths"][0] = 6
    with pytest.raises(RecordError, match="completion_lengths.*\\[0, T=5\\]"):
        records.validate_group(g)
    g = group()
    g["rewards"][1] = np.nan
    with pytest.raises(RecordError, match="'rewards'.*finite"):
        records.validate_group(g)
    g = group()
    g["behaviour_logprobs"][0, 0] = -np.inf
    with pytest.raises(RecordError, match="behaviour_logprobs"):
        records.validate_group(g)
    g = group()
    g["policy_versions"][0, 0] = -1  # the first token is always real (lengths >= 1)
    with pytest.raises(RecordError, match="policy_versions"):
        records.validate_group(g)


def test_group_size_and_max_tokens_bounds():
    g = group(group_size=4, max_tokens=8)
    assert records.validate_group(g, group_size=4, max_tokens=8)["T"] == 8
    with pytest.raises(RecordError, match="G=8"):
        records.validate_group(g, group_size=8)
    with pytest.raises(RecordError, match="max_tokens=6"):
        records.validate_group(g, max_tokens=6)


def test_policy_version_range_against_numpy_oracle():
    g = group(group_size=3, max_tokens=6)
    g["completion_lengths"][:] = [2, 6, 1]
    versions = np.full((3, 6), -1, np.int32)
    versions[0, :2] = [7, 8]
    versions[1, :] = [5, 6, 7, 8, 9, 9]
    versions[2, 0] = 9
    g["policy_versions"] = versions
    real = [v for row, n in zip(versions, [2, 6, 1]) for v in row[:n]]
    assert records.policy_version_range(g) == (min(real), max(real))
    g["completion_lengths"][:] = 0
    assert records.policy_version_range(g) == (-1, -1)


def test_completion_samples_decode_each_completion_with_its_oldest_version():
    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids)) + ("" if skip_special_tokens else "|")

    g = dict(prompt_id=np.int64(7), prompt_tokens=np.array([5, 6], np.int32),
             completion_tokens=np.array([[1, 2, 3, 0], [4, 9, 9, 9]], np.int32),
             completion_lengths=np.array([3, 4], np.int32),
             policy_versions=np.array([[-1, 3, 2, -1], [-1, -1, -1, -1]], np.int32),
             rewards=np.array([0.5, -1.0], np.float32), truncated=np.array([False, True]))
    got = records.completion_samples([g], Tok())
    assert got == [
        {"prompt": "5 6|", "completion": "1 2 3", "completion_ids": [1, 2, 3], "reward": 0.5,
         "version": 2, "prompt_id": 7, "truncated": False},
        {"prompt": "5 6|", "completion": "4 9 9 9", "completion_ids": [4, 9, 9, 9],
         "reward": -1.0, "version": -1, "prompt_id": 7, "truncated": True}]
    g["failed"] = np.array([False, True])                      # record version 2
    assert [s["failed"] for s in records.completion_samples([g], Tok())] == [False, True]


def test_failed_marks_are_optional_bool_per_completion_and_travel():
    """Record version 2: an optional ``failed`` bool [G]; a version-1 record (without it) still
    validates, and the mark survives both framings."""
    g = group(group_size=3, max_tokens=7, prompt_len=5)
    records.validate_group(g)                                   # version 1: no field
    g["failed"] = np.array([False, True, False])
    assert records.validate_group(g)["G"] == 3
    assert_same(records.decode_bytes(records.encode_bytes(g)), g)
    assert_same(records.decode_frames(records.encode_frames(g)), g)
    with pytest.raises(RecordError, match=r"field 'failed': expected dtype bool"):
        records.validate_group(dict(g, failed=np.array([0, 1, 0], np.int32)))
    with pytest.raises(RecordError, match=r"field 'failed': expected shape \[G\] with P=5, "
                       r"G=3, T=7, got shape \[2\]"):
        records.validate_group(dict(g, failed=np.zeros(2, bool)))


def test_multi_turn_samples_keep_each_turn_and_the_raw_ids():
    """An episode rendered with a real chat template (ChatML): the sample keeps the policy's
    and the environment's turns apart, with their special tokens, and the exact ids."""
    from chat_fixtures import tiny_tokenizer
    from rlflow.envs.chat import ChatRenderer, episode_mask

    tok = tiny_tokenizer("chatml")
    r = ChatRenderer(tok)
    conv = [{"role": "user", "content": "guess a digit"}]
    prompt = r.prompt_ids(conv)
    segments, replies = [], ["5", "7"]
    for t, text in enumerate(replies):
        sampled = r.encode(text) + [r.turn_end_id]
        segments.append((sampled, True))
        conv.append({"role": "assistant", "content": text})
        if t == 0:
            new = [{"role": "user", "content": "higher"}]
            segments.append((r.continuation_ids(conv, new), False))
            conv += new
    ids, mask = episode_mask(segments)
    n, pad = len(ids), 3
    g = dict(prompt_id=np.int64(1), prompt_tokens=np.array(prompt, np.int32),
             completion_tokens=np.array([ids + [0] * pad], np.int32),
             completion_lengths=np.array([n], np.int32),
             policy_versions=np.array([[4 if m else -1 for m in mask] + [-1] * pad], np.int32),
             loss_mask=np.array([mask + [0] * pad], bool),
             rewards=np.array([1.0], np.float32), truncated=np.array([False]))
    [s] = records.completion_samples([g], tok)
    assert s["completion_ids"] == ids
    assert [t["role"] for t in s["turns"]] == ["assistant", "environment", "assistant"]
    assert [t["text"] for t in s["turns"]] == [
        "5<|im_end|>", "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n",
        "7<|im_end|>"]
    assert [t["num_tokens"] for t in s["turns"]] == [len(seg) for seg, _ in segments]
    # the old one-string form ran the turns together: "5user\nhigher\nassistant\n7"
    assert "higher" in s["completion"] and "<|im_start|>" not in s["completion"]
