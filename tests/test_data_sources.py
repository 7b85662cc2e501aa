"""Finding, checking and reading data files (raylm.data.sources). No Ray needed."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylm.data.sources import (
    builtin_sample_files,
    builtin_tokenizer_dir,
    iter_text_chunks,
    iter_texts,
    resolve_files,
    validate_files,
)
from raylm.errors import ConfigError

TEXT = "First line, with ünïcödé ✓\n\nSecond line.\r\nThird line\n"


def write(path, data) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return str(path)


def write_jsonl(path, rows) -> str:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def tree(tmp_path):
    """A directory of every supported format, plus files a directory search must skip."""
    write(tmp_path / "data" / "a.txt", TEXT)
    write(tmp_path / "data" / "sub" / "b.text", TEXT)
    write_jsonl(tmp_path / "data" / "sub" / "c.jsonl", [{"text": "x"}])
    write_jsonl(tmp_path / "data" / "d.json", [{"text": "y"}])
    write(tmp_path / "data" / "e.csv", "id,text\n1,z\n")
    pq.write_table(pa.table({"text": ["w"]}), tmp_path / "data" / "f.parquet")
    write(tmp_path / "data" / "README.md", "not data")                 # unsupported: skipped
    write(tmp_path / "data" / ".hidden" / "g.txt", "hidden")           # hidden: skipped
    write(tmp_path / "data" / "_SUCCESS" / "h.txt", "marker dir")      # underscore: skipped
    return tmp_path / "data"


# --- resolve_files -------------------------------------------------------------------------

def test_directory_is_searched_recursively_for_supported_files(tree):
    files = resolve_files([str(tree)])
    names = [os.path.relpath(f, tree) for f in files]
    assert names == ["a.txt", "d.json", "e.csv", "f.parquet", "sub/b.text", "sub/c.jsonl"]
    assert all(os.path.isabs(f) for f in files)


def test_globs_files_uris_sorted_and_deduplicated(tree, monkeypatch):
    monkeypatch.chdir(tree)
    files = resolve_files([
        "sub/*.jsonl",                      # relative glob
        str(tree / "**" / "*.t*t"),         # ** spans directories; skips .hidden/
        f"file://{tree}/e.csv",             # URI: becomes the local path
        str(tree / "e.csv"),                # the same file again
        "a.txt",
    ])
    assert files == sorted(files)
    # Unlike a directory search, a glob skips only dot names (as the shell does).
    assert [os.path.relpath(f, tree) for f in files] == [
        "_SUCCESS/h.txt", "a.txt", "e.csv", "sub/b.text", "sub/c.jsonl"]


def test_file_uris_are_percent_decoded_local_paths(tmp_path):
    from urllib.parse import quote

    path = write(tmp_path / "with space" / "ü.txt", TEXT)
    assert resolve_files([f"file://{quote(path)}"]) == [path]
    assert resolve_files([f"file://{quote(str(tmp_path))}/with%20space/*.txt"]) == [path]
    with pytest.raises(ConfigError, match="^--train_file: no such file or directory: file://"):
        resolve_files([f"file://{tmp_path}/missing.txt"])


def test_glob_character_class_and_single_component_star(tree):
    assert [os.path.basename(f) for f in resolve_files([str(tree / "[a-d].*")])] == [
        "a.txt", "d.json"]
    # '*' does not cross '/': sub/ files are not matched by data/*.jsonl
    with pytest.raises(ConfigError, match="matches no .txt, .text, .jsonl"):
        resolve_files([str(tree / "*.jsonl")])


def test_missing_path_is_an_error_naming_flag_and_path(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ConfigError) as e:
        resolve_files([missing], "--validation_file")
    assert str(e.value) == f"--validation_file: no such file or directory: {missing}"


def test_glob_matching_nothing_is_an_error(tmp_path):
    pattern = str(tmp_path / "*.jsonl")
    with pytest.raises(ConfigError, match=r"^--train_file: .*\*\.jsonl matches no "):
        resolve_files([pattern])


def test_directory_without_supported_files_is_an_error(tmp_path):
    write(tmp_path / "d" / "notes.md", "x")
    with pytest.raises(ConfigError, match="directory .* contains no .txt"):
        resolve_files([str(tmp_path / "d")])


def test_unsupported_extension_is_an_error(tmp_path):
    path = write(tmp_path / "data.xlsx", "x")
    with pytest.raises(ConfigError, match=r"unsupported file type '.xlsx' \(supported: .txt"):
        resolve_files([path])


# --- validate_files ------------------------------------------------------------------------

def test_valid_files_of_every_format_pass(tree):
    validate_files(resolve_files([str(tree)]), None)


def test_empty_file_is_an_error(tmp_path):
    path = write(tmp_path / "empty.txt", b"")
    with pytest.raises(ConfigError) as e:
        validate_files([path], None)
    assert str(e.value) == f"--train_file: {path} is empty"


def test_whitespace_only_text_file_is_an_error(tmp_path):
    path = write(tmp_path / "blank.txt", "\n  \n\t\n")
    with pytest.raises(ConfigError, match="blank.txt is empty"):
        validate_files([path], None)


@pytest.mark.parametrize("name,content", [
    ("header_only.csv", "id,text\n"),
    ("empty_rows.parquet", None),
])
def test_file_with_no_rows_is_an_error(tmp_path, name, content):
    if content is None:
        path = str(tmp_path / name)
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path = write(tmp_path / name, content)
    with pytest.raises(ConfigError, match=f"{name} is empty \\(no rows\\)"):
        validate_files([path], None)


def test_unreadable_parquet_is_an_error_naming_the_file(tmp_path):
    path = write(tmp_path / "broken.parquet", b"this is not parquet at all" * 10)
    with pytest.raises(ConfigError, match=f"^--train_file: cannot read {path} as parquet: "):
        validate_files([path], None)


def test_json_array_is_not_json_lines(tmp_path):
    path = write(tmp_path / "array.json", json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    with pytest.raises(ConfigError, match=f"cannot read {path} as JSON Lines"):
        validate_files([path], None)


@pytest.mark.parametrize("chunk_bytes", [3, 7, 1 << 20])
def test_non_utf8_reports_file_and_exact_byte_offset(tmp_path, chunk_bytes):
    # Multi-byte characters before the bad byte, so chunk boundaries cut through them.
    good = "héllo wörld ✓\nsecond ✓ line\n".encode("utf-8")
    path = write(tmp_path / "latin1.txt", good + b"caf\xe9\n")
    offset = len(good) + 3
    with pytest.raises(ConfigError) as e:
        list(iter_text_chunks(path, chunk_bytes, flag="--train_file"))
    assert str(e.value) == (f"--train_file: {path} is not valid UTF-8: invalid byte at "
                            f"offset {offset}")
    with pytest.raises(ConfigError, match=f"invalid byte at offset {offset}$"):
        validate_files([path], None)


def test_truncated_character_at_end_of_file_is_invalid(tmp_path):
    path = write(tmp_path / "cut.txt", "abc".encode() + "✓".encode()[:2])
    with pytest.raises(ConfigError, match="invalid byte at offset 3$"):
        list(iter_text_chunks(path, 2))


def test_non_utf8_csv_is_an_error(tmp_path):
    path = write(tmp_path / "bad.csv", b"text\nok\n\xff\xfe\n")
    with pytest.raises(ConfigError, match="bad.csv is not valid UTF-8: invalid byte at offset 8"):
        validate_files([path], None)


def test_missing_text_column_lists_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "two.jsonl", [{"title": "a", "body": "b", "n": 1}])
    with pytest.raises(ConfigError) as e:
        validate_files([path], None)
    assert str(e.value) == (
        f"--train_file: {path} has no 'text' column and no single string column "
        "(columns: title (string), body (string), n (int64)); pass --text_column (or, for "
        "rows tokenized already, give an 'input_ids' column of lists of token ids)")
    with pytest.raises(ConfigError, match=r"has no column 'content' \(columns: title"):
        validate_files([path], "content")
    validate_files([path], "body")


def test_token_ids_are_read_where_no_text_column_is():
    """input_ids of token ids is the column only where no text column resolves: 'text',
    or the only string column, comes first (a tokenizing map that kept its text)."""
    from raylm.data.sources import resolve_text_column

    ids, pair = pa.list_(pa.int64()), pa.list_(pa.int32(), 2)
    for fields, want in [([("sentence", pa.string()), ("input_ids", ids)], "sentence"),
                         ([("input_ids", ids), ("attention_mask", ids)], "input_ids"),
                         ([("a", pa.string()), ("b", pa.string()), ("input_ids", ids)],
                          "input_ids"),
                         ([("input_ids", pair)], "input_ids")]:
        assert resolve_text_column(pa.schema(fields), None, "t.parquet") == want, fields
    with pytest.raises(ConfigError, match="no single string column .* for rows tokenized "):
        resolve_text_column(pa.schema([("input_ids", pa.list_(pa.float32()))]), None,
                            "t.parquet")


def test_non_text_parquet_column_is_an_error(tmp_path):
    path = str(tmp_path / "nums.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(ConfigError, match="column 'text' holds int64, neither text nor token ids"):
        validate_files([path], None)


def test_only_string_column_is_the_text(tmp_path):
    csv_path = write(tmp_path / "one.csv", "id,body,score\n1,hello there,0.5\n")
    parquet_path = str(tmp_path / "one.parquet")
    pq.write_table(pa.table({"id": [1], "content": ["hi"]}), parquet_path)
    validate_files([csv_path, parquet_path], None)
    assert list(iter_texts(csv_path)) == [["hello there"]]
    assert list(iter_texts(parquet_path)) == [["hi"]]


# --- reading -------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_bytes", [1, 2, 5, 64, 1 << 20])
def test_text_lines_match_splitlines_whatever_the_chunk_size(tmp_path, chunk_bytes):
    text = "α line\r\nsecond ✓✓\n\nthird\rfourth\n" + "x" * 50 + "\nlast, no newline"
    path = write(tmp_path / "t.txt", text)
    lines = [line for batch in iter_texts(path, chunk_bytes=chunk_bytes) for line in batch]
    kept = [line for batch in iter_texts(path, chunk_bytes=chunk_bytes, keep_linebreaks=True)
            for line in batch]
    # What the `datasets` text loader gives: universal newlines, then splitlines (keeping
    # the ends with keep_linebreaks).
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert lines == text.splitlines()
    assert kept == text.splitlines(keepends=True)


def test_table_texts_in_row_order_with_nulls_as_empty(tmp_path):
    csv_text = 'id,text,label\n1,"multi\nline, ""quoted""",a\n2,,b\n3,123,c\n'
    path = write(tmp_path / "t.csv", csv_text)
    assert [t for b in iter_texts(path) for t in b] == ['multi\nline, "quoted"', "", "123"]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}, {"text": None}, {"text": "c"}])
    assert [t for b in iter_texts(path) for t in b] == ["a", "", "c"]


# --- the built-in sample -------------------------------------------------------------------

def test_builtin_sample_is_three_or_four_plays_and_a_4096_bpe_tokenizer():
    from transformers import AutoTokenizer

    files = builtin_sample_files()
    assert 3 <= len(files) <= 4
    assert 300_000 <= sum(os.path.getsize(f) for f in files) <= 450_000
    validate_files(files, None)
    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir())
    assert tok.is_fast and len(tok) == 4096
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    text = "Is this a dagger which I see before me?"
    assert tok.decode(tok(text)["input_ids"]) == text


@pytest.mark.parametrize("keep", [True, False])
def test_text_lines_are_what_the_datasets_text_loader_gives(tmp_path, keep):
    # run_clm reads .txt files with load_dataset("text", keep_linebreaks=...).
    import datasets

    path = write(tmp_path / "t.txt", "α line\r\nsecond ✓✓\n\nthird\rfourth\nlast")
    loaded = datasets.load_dataset("text", data_files=path, keep_linebreaks=keep,
                                   cache_dir=str(tmp_path / "hf"), split="train")
    ours = [line for batch in iter_texts(path, keep_linebreaks=keep) for line in batch]
    assert ours == loaded["text"]


@pytest.mark.parametrize("piece", ["whole", "holding it", "after it", "before it"])
def test_a_bad_json_line_is_named_by_its_byte_offset(tmp_path, piece):
    """pyarrow's JSON reader names a row of its block; the error names the line's byte
    offset in the file, whether the file is read whole or in pieces (--streaming, large
    files), and whichever piece meets it (the schema is read from the file's start)."""
    rows = [json.dumps({"text": f"row {i} é"}) for i in range(20000)]
    rows[12000] = '{"text": "no closing quote'
    data = ("\n".join(rows) + "\n").encode("utf-8")
    path = write(tmp_path / "rows.jsonl", data)
    offset = data.index(b'{"text": "no closing')
    ranges = {"whole": None, "holding it": (offset - 100, offset + 5000),
              "after it": (offset + 10, None), "before it": (0, offset - 10)}
    with pytest.raises(ConfigError, match=rf"^cannot read {path} as JSON Lines: the line at "
                                          rf"byte offset {offset} is not JSON \(Unterminated "
                                          rf"string"):
        for _ in iter_texts(path, piece=ranges[piece]):
            pass
