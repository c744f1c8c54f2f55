"""Prompt-record sources (JSONL, parquet, ArrayRecord, globs) and their bad-input errors.

Records are written here with the formats' own writers (json, pyarrow, array_record) and read
back through ``rlflow.data.sources`` and the prompt pipeline.
"""

import json
import string

import pytest

from rlflow.config import DataConfig
from rlflow.data.pipeline import build_prompt_pipeline
from rlflow.data.sources import (BadRecordError, EmptyDatasetError, MissingFieldError,
                                 open_source)
from rlflow.data.tokenizer import build_char_tokenizer

RECORDS = [{"question": f"what is {i} plus {i}?", "answer": str(2 * i), "extra": i}
           for i in range(7)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(string.ascii_letters + string.digits + " ?.,#:'\n",
                                str(tmp_path_factory.mktemp("tok")))


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def cfg(path, **kw):
    return DataConfig(source=kw.pop("source", "jsonl"), path=path, **kw)


def test_jsonl_reads_objects_skips_blank_lines_and_counts_them_in_locations(tmp_path):
    lines = [json.dumps(RECORDS[0]), "", "   ", json.dumps(RECORDS[1]), json.dumps(RECORDS[2])]
    path = write_jsonl(tmp_path / "a.jsonl", lines)
    src = open_source("jsonl", path)
    assert len(src) == 3
    assert [src[i] for i in range(3)] == RECORDS[:3]
    assert src.location(1) == f"{path}:4"  # the editor's line number (blank lines count)


def test_malformed_line_names_file_and_line(tmp_path, tok):
    lines = [json.dumps(r) for r in RECORDS[:3]]
    lines.insert(2, '{"question": "broken", ')  # line 3
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(BadRecordError, match=r"bad\.jsonl:3: malformed JSON.*on_bad_record='skip'"):
        build_prompt_pipeline(cfg(path, num_epochs=1), tok, seed=0)


def test_malformed_json_message_reads_as_one_sentence(tmp_path):
    """json's own message ("Invalid control character at") is not followed by a second
    "at": the record's message says where once."""
    path = write_jsonl(tmp_path / "ctl.jsonl", ['{"question": "a\tb"}'])
    with pytest.raises(BadRecordError) as e:
        open_source("jsonl", path)[0]
    assert str(e.value) == (f"{path}:1: malformed JSON (Invalid control character at "
                            f"character 15 of the record)")


def test_non_object_line_is_a_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "list.jsonl", [json.dumps(RECORDS[0]), "[1, 2]"])
    src = open_source("jsonl", path)
    with pytest.raises(BadRecordError, match=r"list\.jsonl:2: expected a JSON object, got list"):
        src[1]


def test_malformed_lines_skipped_and_counted(tmp_path, tok):
    lines = [json.dumps(r) for r in RECORDS[:4]]
    lines[1] = "not json"
    lines.append(json.dumps({"answer": "1"}))  # line 5: no question
    path = write_jsonl(tmp_path / "skip.jsonl", lines)
    it, stats = build_prompt_pipeline(cfg(path, num_epochs=1, on_bad_record="skip"), tok, seed=0)
    got = list(it)
    assert stats.num_records == 5 and stats.num_bad == 2 and stats.num_kept == 3
    assert sorted(e["prompt_id"] for e in got) == [0, 2, 3]
    assert "skip.jsonl:2" in stats.first_bad[0] and "skip.jsonl:5" in stats.first_bad[1]
    assert "missing field 'question'" in stats.first_bad[1]


def test_missing_field_is_named(tmp_path, tok):
    path = write_jsonl(tmp_path / "f.jsonl", [json.dumps(r) for r in RECORDS[:2]])
    with pytest.raises(MissingFieldError,
                       match=r"f\.jsonl:1: missing field 'prompt' \(data\.prompt_field\).*"
                             r"\['answer', 'extra', 'question'\]"):
        build_prompt_pipeline(cfg(path, prompt_field="prompt"), tok, seed=0)
    with pytest.raises(MissingFieldError, match=r"missing field 'solution' \(data\.answer_field\)"):
        build_prompt_pipeline(cfg(path, answer_field="solution"), tok, seed=0)


def test_missing_field_everywhere_in_skip_mode_is_an_empty_dataset(tmp_path, tok):
    path = write_jsonl(tmp_path / "f.jsonl", [json.dumps(r) for r in RECORDS[:3]])
    with pytest.raises(EmptyDatasetError, match=r"all 3 records .* are bad; first: .*missing "
                                                r"field 'prompt'"):
        build_prompt_pipeline(cfg(path, prompt_field="prompt", on_bad_record="skip"), tok, seed=0)


def test_wrong_field_type_is_a_bad_record(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [json.dumps({"question": 5, "answer": "1"})])
    with pytest.raises(BadRecordError, match=r"t\.jsonl:1: field 'question' must be a string, got int"):
        build_prompt_pipeline(cfg(path), tok, seed=0)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_dataset(tmp_path, tok, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(EmptyDatasetError, match=r"empty: no records in .*empty\.jsonl"):
        build_prompt_pipeline(cfg(str(path)), tok, seed=0)


def test_no_matching_file(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match=r"data\.path: no jsonl file matches"):
        build_prompt_pipeline(cfg(str(tmp_path / "nope-*.jsonl")), tok, seed=0)


def test_glob_concatenates_files_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "part-1.jsonl", [json.dumps(r) for r in RECORDS[3:]])
    write_jsonl(tmp_path / "part-0.jsonl", [json.dumps(r) for r in RECORDS[:3]])
    src = open_source("jsonl", str(tmp_path / "part-*.jsonl"))
    assert [src[i] for i in range(len(src))] == RECORDS
    assert src.location(4).endswith("part-1.jsonl:2")


def _elements(path, tok, source):
    it, stats = build_prompt_pipeline(cfg(path, source=source, num_epochs=1), tok, seed=3)
    return sorted((e["prompt_id"], e["prompt_text"], e["answer"], e["prompt_tokens"].tolist())
                  for e in it), stats


def test_parquet_and_arrayrecord_give_the_same_prompts_as_jsonl(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    jsonl = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in RECORDS])
    pq.write_table(pa.Table.from_pylist(RECORDS), str(tmp_path / "d.parquet"))
    writer = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
    for r in RECORDS:
        writer.write(json.dumps(r).encode("utf-8"))
    writer.close()

    want, _ = _elements(jsonl, tok, "jsonl")
    assert [w[0] for w in want] == list(range(len(RECORDS)))
    assert [w[2] for w in want] == [r["answer"] for r in RECORDS]
    for path, source in ((str(tmp_path / "d.parquet"), "parquet"),
                         (str(tmp_path / "d.array_record"), "arrayrecord")):
        got, stats = _elements(path, tok, source)
        assert got == want, source
        assert stats.num_records == len(RECORDS)


def test_arrayrecord_entry_that_is_not_json_names_the_entry(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "x.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    writer.write(json.dumps(RECORDS[0]).encode())
    writer.write(b"\xff\xfe binary")
    writer.close()
    src = open_source("arrayrecord", path)
    assert src[0] == RECORDS[0]
    with pytest.raises(BadRecordError, match=r"x\.array_record: entry 1: not a UTF-8 JSON object"):
        src[1]


def test_unreadable_parquet_names_the_file(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(BadRecordError, match=r"junk\.parquet: not a readable parquet file"):
        open_source("parquet", str(path))
