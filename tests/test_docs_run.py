"""Docs that run (#27): the fenced shell blocks of README.md and docs/*.md that claim to run are
run as written, in a scratch copy of the repository's files (a fresh clone: no ``.cache``, no
``logs``; ``.venv`` linked in, its ``bin`` first on PATH as after ``source .venv/bin/activate``).

The fence's info string says what a block is (GitHub highlights by its first word):

- ```` ```sh ````: runs as written, fast, no server, no data (one ``bash -e`` per block);
- ```` ```sh exit-2 ````: one command that must exit 2; the ``# error: ...`` comment under it is
  the expected stderr line (whitespace-normalised);
- ```` ```sh serve ````: the README's server command; the test starts it once and stops it;
- ```` ```sh client ```` / ```` ```python client ````: run against that one server;
- ```` ```sh data ````: needs the SGLang dumps at ``../shared/data/sglang_ep_statistics``
  (README: where they come from); run when they are there, skipped otherwise;
- ```` ```bash ````: long runs (servers, benchmarks, several terminals, downloads): listed by
  :func:`test_long_blocks_are_listed`, not run here (the closing note of #27 has them run by
  hand).

Two substitutions, so runs never collide: ``/tmp/xllm-eplb`` becomes a scratch folder, and the
server's port ``8000`` a free port (``--port 8000``, ``localhost:8000``, ``127.0.0.1:8000``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from xllm_eplb.testing.serving import Server, free_port, shm_objects

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\w*)[ \t]*(\S*)\s*$")
#: the markers each language may carry ("" = none)
MARKERS = {"sh": {"", "exit-2", "serve", "client", "data"}, "python": {"", "client"}}
DATA = (ROOT / ".." / "shared" / "data" / "sglang_ep_statistics").resolve()
BLOCK_TIMEOUT = 120


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    marker: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file (indented ones in lists too, dedented)."""
    out, cur, body = [], None, []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if cur is None and m and (m[2] or m[3] == ""):
            cur, body = (i, m[1], m[2], m[3]), []
        elif cur is not None and line.strip() == "```":
            start, indent, lang, marker = cur
            text = "\n".join(b[len(indent):] if b.startswith(indent) else b for b in body)
            out.append(Block(path, start, lang, marker, text + "\n"))
            cur = None
        elif cur is not None:
            body.append(line)
    return out


ALL = [b for p in DOCS for b in blocks(p)]


def of(lang: str, marker: str) -> list[Block]:
    return [b for b in ALL if b.lang == lang and b.marker == marker]


def _ids(bs: list[Block]) -> list[str]:
    return [b.where for b in bs]


def test_every_block_has_a_known_marker():
    bad = [f"{b.where}: ```{b.lang} {b.marker}" for b in ALL
           if b.lang in MARKERS and b.marker not in MARKERS[b.lang]]
    assert not bad, "unknown markers (see tests/test_docs_run.py): " + "; ".join(bad)
    serve = of("sh", "serve")
    assert len(serve) == 1 and serve[0].path.name == "README.md", _ids(serve)
    assert len(of("sh", "")) >= 2 and of("sh", "client") and of("sh", "data")


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> dict:
    """A scratch copy of the repository's tracked files, ``.venv`` linked in; the shared data
    linked beside it as ``../shared`` when this checkout has it. -> {cwd, env, out}."""
    tmp = tmp_path_factory.mktemp("docs")
    cwd = tmp / "clone"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (cwd / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, cwd / f)
    (cwd / ".venv").symlink_to(ROOT / ".venv")
    if DATA.is_dir():
        (tmp / "shared" / "data").mkdir(parents=True)
        (tmp / "shared" / "data" / "sglang_ep_statistics").symlink_to(DATA)
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    return {"cwd": cwd, "env": env, "out": tmp / "out"}


@pytest.fixture(scope="module")
def readme_server(clone, tmp_path_factory):
    """The README's ``serve`` command as written (port substituted); killed and swept at the end
    of the module whatever happened. (Booting it while the plain blocks run made both slower on
    the shared 2 cores: no overlap.)"""
    port = free_port()
    (serve,) = of("sh", "serve")
    cmd = ["bash", "-c", "exec " + _subst(serve.text, clone, port).strip()]
    s = Server.launch(tmp_path_factory.mktemp("readme_server"), [], cmd=cmd, cwd=clone["cwd"],
               env=clone["env"], port=port)
    yield s
    s.kill()


def _subst(text: str, clone: dict, port: int | None = None) -> str:
    text = text.replace("/tmp/xllm-eplb", str(clone["out"]))
    if port is not None:
        text = re.sub(r"(--port[ =]|localhost:|127\.0\.0\.1:)8000\b", rf"\g<1>{port}", text)
    return text


def _run(b: Block, clone: dict, port: int | None = None) -> subprocess.CompletedProcess:
    text = _subst(b.text, clone, port)
    cmd = ["python", "-c", text] if b.lang == "python" else ["bash", "-e", "-c", text]
    # NOTE: its own session, so a block that overruns is killed with everything it started
    p = subprocess.Popen(cmd, cwd=clone["cwd"], env=clone["env"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)        # a server: graceful stop, shm swept
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        raise AssertionError(f"{b.where}: still running after {BLOCK_TIMEOUT} s (a long run "
                             f"belongs in a `bash` block)\n--- block\n{b.text}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _ok(b: Block, r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, (f"{b.where}: exit {r.returncode}\n--- block\n{b.text}"
                               f"--- stdout\n{r.stdout[-3000:]}--- stderr\n{r.stderr[-3000:]}")
    assert "Traceback" not in r.stderr, f"{b.where}:\n{r.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plain_sh_blocks_run_as_written(clone):
    for b in of("sh", ""):
        _ok(b, _run(b, clone))
    assert (clone["out"] / "sim" / "summary.json").is_file()     # the README's own outputs
    assert not (ROOT / "tmp").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_error_examples_print_the_documented_line(clone):
    for b in of("sh", "exit-2"):
        cmd = [ln for ln in b.text.splitlines() if ln.strip() and not ln.startswith("#")]
        want = " ".join(ln.lstrip("# ").strip() for ln in b.text.splitlines()
                        if ln.startswith("#"))
        assert len(cmd) == 1 and want.startswith("error: "), b.where
        r = _run(b, clone)
        assert r.returncode == 2, f"{b.where}: exit {r.returncode}: {r.stderr}"
        assert " ".join(r.stderr.split()) == want, b.where


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_blocks_run_with_the_sglang_dumps(clone):
    if not DATA.is_dir():
        pytest.skip(f"no SGLang dumps at {DATA} (README: 'Real DeepSeek-V3/R1 expert loads'): "
                    f"not run: {_ids(of('sh', 'data'))}")
    for b in of("sh", "data"):
        _ok(b, _run(b, clone))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_client_blocks_run_against_the_readme_server(clone, readme_server):
    """Every ``client`` block against the README's server: exit 0, no OpenAI error object, no
    U+FFFD in the streamed text; then a clean stop (SIGTERM: exit 0, no shm left)."""
    s = readme_server
    s.wait_ready(timeout=240)
    for b in [*of("sh", "client"), *of("python", "client")]:
        t0 = time.monotonic()
        r = _run(b, clone, s.port)
        print(f"{b.where}: {time.monotonic() - t0:.1f} s")     # pytest -s shows them
        _ok(b, r)
        assert '"error"' not in r.stdout, f"{b.where}:\n{r.stdout[-3000:]}"
        assert "\ufffd" not in r.stdout, f"{b.where}: U+FFFD in\n{r.stdout[-3000:]}"
    assert (clone["out"] / "placement.json").is_file()    # planned from its own dump
    assert (clone["cwd"] / "logs" / "latest" / "engine.log").is_file()
    s.note_children()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0, s.err.read_text()[-3000:]
    assert shm_objects(s.run_id) == []

def test_long_blocks_are_listed(capsys):
    """The ``bash`` blocks are not run here; this prints them (``pytest -s``), one per line."""
    long = of("bash", "")
    with capsys.disabled():
        print("\nlong-running doc blocks, not run by this test (run by hand):")
        for b in long:
            first = next((ln for ln in b.text.splitlines() if ln and not ln.startswith("#")), "")
            print(f"  {b.where}: {first[:90]}")
    assert long
