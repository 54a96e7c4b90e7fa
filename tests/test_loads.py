"""Load-file reading: formats, dense-layer skipping, errors naming the file and the problem."""

import json
from pathlib import Path

import numpy as np
import pytest

from xllm_eplb.eplb.loads import parse_layer_range, read_loads
from xllm_eplb.errors import InputFileError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sglang_ep_statistics"


def test_sglang_dump_skips_dense_rows(tmp_path):
    p = tmp_path / "dump.json"
    p.write_text(json.dumps({"logical_count": [[0, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 4.0]]}))
    lf = read_loads(p)
    assert lf.dense_skipped == 2 and lf.loads.tolist() == [[1, 2, 3, 4]]
    assert lf.loads.dtype == np.int64


def test_list_json_and_npy(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps([[1.5, 2], [3, 4]]))
    lf = read_loads(tmp_path / "l.json")
    assert lf.loads.dtype == np.float64 and lf.dense_skipped == 0
    np.save(tmp_path / "a.npy", np.array([[0, 0], [5, 6]]))
    assert read_loads(tmp_path / "a.npy").loads.tolist() == [[5, 6]]


@pytest.mark.parametrize("content,msg", [
    ('{"x": 1}', "logical_count"),
    ("[[1, 2], [3]]", "different expert counts"),
    ("[[1, -2]]", "layer 0 expert 1 is -2"),
    ("[[1, NaN]]", "must be finite"),
    ("[1, 2]", "list of per-layer lists"),
    ("[[0, 0]]", "every layer has zero load"),
    ("{not json", "invalid JSON"),
    ('[["a", 1]]', "must be numbers"),
])
def test_bad_files_name_file_and_problem(tmp_path, content, msg):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(InputFileError, match=msg) as ei:
        read_loads(p)
    assert str(p) in str(ei.value)


def test_missing_and_unknown_type(tmp_path):
    with pytest.raises(InputFileError, match="not found"):
        read_loads(tmp_path / "nope.json")
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(InputFileError, match="unknown load-file type"):
        read_loads(tmp_path / "x.csv")
    np.save(tmp_path / "v.npy", np.arange(4))
    with pytest.raises(InputFileError, match="not a non-empty"):
        read_loads(tmp_path / "v.npy")


def test_layer_range():
    assert parse_layer_range(None, 5) == range(5)
    assert parse_layer_range("1:3", 5) == range(1, 3)
    assert parse_layer_range(":2", 5) == range(0, 2)
    for bad in ("3:1", "0:9", "x"):
        with pytest.raises(InputFileError, match="--moe-layers"):
            parse_layer_range(bad, 5)


@pytest.mark.skipif(not DATA.is_dir(), reason="real load data absent")
def test_real_dump_shape():
    lf = read_loads(DATA / "prefill_in4096.json")
    assert lf.dense_skipped == 3 and lf.loads.shape == (58, 256)
