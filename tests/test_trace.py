"""Load traces (.npz) and the --generate mini-language."""

import json
from pathlib import Path

import numpy as np
import pytest

from xllm_eplb.errors import ConfigError, InputFileError
from xllm_eplb.sim.generators import _mix_weights, generate, parse_spec, read_static_loads
from xllm_eplb.sim.trace import Trace, load_trace, save_trace

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "sglang_ep_statistics"
needs_data = pytest.mark.skipif(not (DATA / "decode_in1000out1000.json").is_file(),
                                reason="../shared/data not present")


def test_roundtrip(tmp_path):
    loads = np.arange(2 * 3 * 4, dtype=np.int64).reshape(2, 3, 4)
    p = save_trace(Trace(loads, {"generator": "test"}), tmp_path / "t.npz")
    tr = load_trace(p)
    assert tr.loads.dtype == np.int64 and (tr.loads == loads).all()
    assert (tr.steps, tr.layers, tr.experts) == (2, 3, 4) and tr.meta == {"generator": "test"}
    assert tr.head(1).steps == 1


@pytest.mark.parametrize("loads, msg", [
    (np.zeros((3, 4)), r"shape \(3, 4\)"),
    (np.zeros((0, 2, 2)), "non-empty"),
    (np.array([[[1.0, np.nan]]]), r"loads\[0, 0, 1\] = nan: counts must be finite"),
    (np.array([[[1, -2]]]), r"loads\[0, 0, 1\] = -2: counts must be >= 0"),
    (np.array([[[1.5, 2]]]), "whole numbers"),
    (np.array([[["a", "b"]]]), "dtype"),
])
def test_bad_traces_name_file_value_and_rule(tmp_path, loads, msg):
    p = tmp_path / "bad.npz"
    np.savez(p, loads=loads)
    with pytest.raises(InputFileError, match=msg) as e:
        load_trace(p)
    assert str(p) in str(e.value)


def test_unreadable_or_incomplete_files(tmp_path):
    with pytest.raises(InputFileError, match="not found"):
        load_trace(tmp_path / "nope.npz")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(InputFileError, match="cannot read"):
        load_trace(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(InputFileError, match="no 'loads' array"):
        load_trace(tmp_path / "other.npz")


def test_parse_spec():
    assert parse_spec("sglang:a->b,steps=10") == ("sglang", ["a->b"], {"steps": "10"})
    assert parse_spec("ZIPF:layers=2") == ("zipf", [], {"layers": "2"})


@pytest.mark.parametrize("spec, msg", [
    ("zipf", "expected KIND"),
    ("poisson:steps=3", "unknown kind 'poisson'"),
    ("zipf:layer=3", "unknown key 'layer'"),
    ("zipf:steps=1.5", "steps=1.5: must be an integer"),
    ("zipf:skew=abc", "skew=abc: must be a number"),
    ("zipf:tokens=0", "tokens=0: must be >= 1"),
    ("sglang:steps=3", "one source chain"),
    ("sglang:a,mode=zigzag", "mode=zigzag"),
])
def test_bad_specs(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        generate(spec)


def _top_share(loads):
    tot = loads.sum(axis=0).astype(float)                  # [layers, experts]
    return tot.max(axis=1) / tot.sum(axis=1)


def test_zipf_shapes_counts_and_depth_skew():
    tr = generate("zipf:layers=6,experts=32,steps=50,tokens=100,topk=4,skew=0.8,depth=1.5,seed=3")
    assert tr.loads.shape == (50, 6, 32) and tr.loads.dtype == np.int64
    assert (tr.loads.sum(axis=2) == 400).all()             # tokens * topk per layer per step
    share = _top_share(tr.loads)
    assert share[-1] > share[0] * 1.5                      # deeper layers are more skewed
    again = generate("zipf:layers=6,experts=32,steps=50,tokens=100,topk=4,skew=0.8,depth=1.5,"
                     "seed=3")
    assert (again.loads == tr.loads).all()                 # deterministic per seed
    assert json.dumps(tr.meta)


def test_zipf_shift_and_drift_change_the_hot_set():
    tr = generate("zipf:layers=2,experts=64,steps=200,skew=1.5,shift_every=100,seed=1")
    a, b = tr.loads[:100].sum(0), tr.loads[100:].sum(0)
    assert (a.argmax(axis=1) != b.argmax(axis=1)).any()
    still = generate("zipf:layers=2,experts=64,steps=200,skew=1.5,seed=1")
    c, d = still.loads[:100].sum(0), still.loads[100:].sum(0)
    assert (c.argmax(axis=1) == d.argmax(axis=1)).all()
    drift = generate("zipf:layers=2,experts=64,steps=400,skew=1.0,drift=0.05,seed=1")
    x, y = drift.loads[:50].sum(0).astype(float), drift.loads[-50:].sum(0).astype(float)
    assert np.corrcoef(np.log1p(x[0]), np.log1p(y[0]))[0, 1] < 0.9


def test_mix_weights():
    assert _mix_weights(4, 2, "switch", 0)[:, 1].tolist() == [0, 0, 1, 1]
    assert _mix_weights(8, 2, "switch", 2)[:, 1].tolist() == [0, 0, 0, 0, 0, 0.5, 1, 1]
    np.testing.assert_allclose(_mix_weights(3, 2, "interp", 0)[:, 1], [0, 0.5, 1])
    np.testing.assert_allclose(_mix_weights(6, 3, "switch", 0).sum(axis=1), 1.0)


@needs_data
def test_sglang_series_from_real_dumps():
    a = read_static_loads(DATA / "decode_in1000out1000.json")
    assert a.shape == (58, 256)                            # 3 dense rows dropped
    tr = generate(f"sglang:decode_in1000out1000->decode_in500out1500,steps=40,tokens=512,"
                  f"layers=4,dir={DATA}")
    assert tr.loads.shape == (40, 4, 256) and (tr.loads.sum(axis=2) == 512 * 8).all()
    first = tr.loads[:20].sum(0).astype(float)
    corr = np.corrcoef(first[0], a[0])[0, 1]
    assert corr > 0.8                                      # sampled from the first file


def test_read_static_loads_errors(tmp_path):
    (tmp_path / "x.json").write_text('{"other": 1}')
    with pytest.raises(InputFileError, match="without a 'logical_count' key"):
        read_static_loads(tmp_path / "x.json")
    np.save(tmp_path / "z.npy", np.zeros((3, 4)))
    with pytest.raises(InputFileError, match="every layer has zero load"):
        read_static_loads(tmp_path / "z.npy")
    with pytest.raises(InputFileError, match="not found"):
        generate(f"sglang:missing_file,steps=2,dir={tmp_path}")
    with pytest.raises(ConfigError, match="needs a folder: dir=PATH in the spec"):
        generate("sglang:missing_file,steps=2")           # library code assumes no folder
    with pytest.raises(InputFileError, match=f"not found in {tmp_path}"):
        generate("sglang:missing_file,steps=2", data_dir=tmp_path)


def test_sglang_names_resolve_in_the_given_data_dir(tmp_path):
    (tmp_path / "a.json").write_text('{"logical_count": [[0, 0, 0, 0], [1, 2, 3, 4]]}')
    tr = generate("sglang:a,steps=3,tokens=10,topk=2", data_dir=tmp_path)
    assert tr.loads.shape == (3, 1, 4) and (tr.loads.sum(axis=2) == 20).all()
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(InputFileError, match=f"not found in {other}"):   # dir= in the spec wins
        generate(f"sglang:a,steps=3,dir={other}", data_dir=tmp_path)
