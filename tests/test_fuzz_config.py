"""Config and flag values fuzzed with hypothesis (issue #17): whatever the value of any flag, of a
``--fault_inject`` spec, of a ``--config`` YAML file or of a ``--flagfile`` line, the CLI either
accepts it (exit 0) or exits 2 with exactly one ``error: ...`` line -- never a traceback.

In-process through click's runner on ``xllm-eplb config show`` (the same resolution ``serve``
runs, without starting anything). Quick by default; the long run (docs/benchmarks.md)::

    .venv/bin/python -m pytest tests/test_fuzz_config.py --hypothesis-profile=fuzz-long --timeout=0 -q
"""

from __future__ import annotations

import math

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xllm_eplb.cli import cli
from xllm_eplb.config import FIELDS

#: 40 examples per test in a plain run (make test); a chosen profile's count otherwise (the
#: hypothesis plugin loads ``--hypothesis-profile`` before this module is imported)
_N = settings.default.max_examples
QUICK = settings(max_examples=40 if _N == settings.get_profile("default").max_examples else _N,
                 deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: ``--v=debug`` prints the traceback on purpose
NAMES = sorted(n for n in FIELDS if n != "v")
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=24)
NUMBERS = st.one_of(st.integers(-2**70, 2**70).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr),
                    st.sampled_from(["nan", "inf", "-inf", "1e309", "0x10", "1_000", " 3 ",
                                     "", "-0", "true", "False", "yes", "none", "[]", "{}"]))
VALUES = st.one_of(TEXT, NUMBERS)


def _check(args: list[str]):
    r = CliRunner().invoke(cli, ["config", "show", *args])
    out = r.output
    assert r.exit_code in (0, 2), (args, r.exit_code, out[-2000:], r.exception)
    assert "Traceback" not in out, (args, out[-2000:])
    if r.exit_code == 2:
        errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, (args, out[-2000:])
    else:
        assert r.exception is None, (args, r.exception)
    return r


@QUICK
@given(name=st.sampled_from(NAMES), value=VALUES)
def test_any_flag_value_is_accepted_or_one_error_line(name, value):
    _check([f"--{name}={value}"])


@QUICK
@given(name=st.sampled_from(NAMES), a=VALUES, b=VALUES)
def test_flag_given_twice_or_split_is_accepted_or_one_error_line(name, a, b):
    _check([f"--{name}", a, f"--{name}={b}"])


@QUICK
@given(name=TEXT.filter(lambda s: s.replace("-", "").replace("_", "") and "=" not in s),
       value=VALUES)
def test_unknown_or_mangled_flag_names(name, value):
    _check([f"--{name}={value}"])


SPEC = st.one_of(
    TEXT,
    st.builds(lambda k, kv: k + ":" + ",".join(f"{a}={b}" for a, b in kv),
              st.sampled_from(["prepare_delay", "prepare_fail", "p2p_delay", "p2p_fail",
                               "crash", "slow_step", "corrupt_output", "Crash", ""]),
              st.lists(st.tuples(st.sampled_from(["rank", "layer", "round", "step", "seconds",
                                                  "phase", "mode", "x", ""]), VALUES),
                       max_size=4)))


@QUICK
@given(specs=st.lists(SPEC, min_size=1, max_size=3), enable=st.booleans())
def test_fault_inject_specs(specs, enable):
    _check(["--ep-size", "2", f"--enable_fault_injection={str(enable).lower()}",
            *[f"--fault_inject={s}" for s in specs]])


YAML_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**66, 2**66),
              st.floats(allow_nan=True, allow_infinity=True), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)


@QUICK
@given(doc=st.dictionaries(st.one_of(st.sampled_from(NAMES + ["eplb", "model", "serve"]), TEXT),
                           YAML_VALUES, max_size=4))
def test_config_file_contents(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("fz") / "c.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    _check(["--config", str(path)])


@QUICK
@given(raw=st.binary(max_size=200))
def test_raw_config_and_flagfile_bytes(tmp_path_factory, raw):
    d = tmp_path_factory.mktemp("fz")
    (d / "c.yaml").write_bytes(raw)
    (d / "f.flags").write_bytes(raw)
    _check(["--config", str(d / "c.yaml")])
    _check(["--flagfile", str(d / "f.flags")])


def test_the_strategies_reach_both_outcomes():
    """The fuzzers above are not vacuous: a valid and an invalid value of the same flag."""
    assert _check(["--eplb_update_interval=5"]).exit_code == 0
    assert _check([f"--eplb_update_interval={math.nan}"]).exit_code == 2


def test_non_finite_yaml_numbers_are_one_error_line(tmp_path):
    """Found by the long fuzz run: a YAML ``.inf`` / ``.nan`` crashed the value's rendering
    (``int(inf)``) before the field's rule could name it."""
    for key in ("ep_size", "eplb_update_interval", "seed"):
        for v in (".inf", "-.inf", ".nan"):
            path = tmp_path / "c.yaml"
            path.write_text(f"{key}: {v}\n")
            r = _check(["--config", str(path)])
            assert r.exit_code == 2 and f"--{key}=" in r.output, r.output
