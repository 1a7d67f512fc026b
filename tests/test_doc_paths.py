"""Every repository path the documentation names exists.

The documents are every tracked Markdown file (README.md, docs/*.md,
benchmarks/results/README.md, ...). A name counts as a path when it has a `/` or ends in
a file extension the repository uses (.py, .sh, .md, .json, .png, ...), in a code span,
a fenced block or plain prose. It must then exist, as written (brace lists and `*`
expanded), relative to the repository root, to the document's own folder or to
`gemma4_kv/` (the README's `keys/engine.py`); a bare file name (`weights.py`) must be the
name of a file in the repository, a bare folder name (`server/`) that of a folder.
Placeholders of a command (`OUT.json`, `DIR/work`, `A/sweep.json`: an upper-case first
part) are not paths. Names of vLLM's and LMCache's own files must exist in
the installed package. What is left over is listed in NOT_PATHS, each with why.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = ("py", "sh", "md", "json", "png", "txt", "toml", "yaml", "yml", "cfg", "jsonl",
              "so", "cu", "c", "h")

NOT_PATHS = {
    # Files of a Hugging Face checkpoint (README, "Which requests are cached").
    "config.json": "a checkpoint's file",
    "preprocessor_config.json": "a checkpoint's file",
    "processor_config.json": "a checkpoint's file",
    "video_preprocessor_config.json": "a checkpoint's file",
    # Arguments and outputs of a benchmark command (benchmarks/results/README.md).
    "ttft.json": "a command's output argument",
    "ttft.png": "a command's output argument",
    "f1.5/serving.json": "a file in a sweep's output folder, not committed",
    ".gpu-vllm/env.sh": "built by benchmarks/gpu/bundle.sh for the GPU machine, not committed",
    # Words with a slash that are no paths (README).
    "application/json": "a media type in a curl command",
    "full/sliding": "the attention kinds the start-up line names",
}

UPSTREAM = ("vllm", "lmcache")
"""Packages whose own files the documents name (e.g. LMCache's
`l2_adapters/valkey_l2_adapter.py`): such a name must exist in the installed package."""


def _documents() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode == 0 and out.stdout.strip():
        return [ROOT / p for p in out.stdout.split()]
    return sorted(p for p in ROOT.rglob("*.md") if ".venv" not in p.parts)


@functools.cache
def _repo_files() -> frozenset[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return frozenset(out.stdout.split())
    return frozenset(str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                     if p.is_file() and ".venv" not in p.parts)


@functools.cache
def _upstream_files() -> frozenset[str]:
    files = set()
    for name in UPSTREAM:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        base = Path(next(iter(spec.submodule_search_locations)))
        files.update(str(p.relative_to(base.parent)) for p in base.rglob("*.py"))
    return frozenset(files)


_EXT = "|".join(EXTENSIONS)
_PATHLIKE = re.compile(rf"^(?:[\w.{{}},*-]+/)+(?:[\w.{{}},*-]+)?$|^[\w.{{}},*-]+\.(?:{_EXT})$")
_PROSE = re.compile(rf"(?<![\w/.`~$-])(?:[\w.-]+/)+[\w.-]+\.(?:{_EXT})\b")


def _words(text: str) -> list[str]:
    """Path-like names in code spans, fenced blocks and prose."""
    words = []
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", prose)
    for chunk in spans + fenced:
        words += chunk.split()
    words += _PROSE.findall(re.sub(r"`[^`]+`", "", prose))
    out = []
    for w in words:
        w = w.strip("\"'(),;:[]<>")
        if (not w or "://" in w or w.startswith(("/", "~", "$", "-", ".venv")) or "=" in w
                or "@" in w):
            continue
        if re.match(r"[A-Z]+[./]", w):
            continue  # a placeholder: OUT.json, DIR/work
        if _PATHLIKE.match(w) and not re.fullmatch(r"[\d.x/]+", w):
            out.append(w)
    return out


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",")
            for x in _expand(name[:m.start()] + alt + name[m.end():])]


def _exists(name: str, doc: Path) -> bool:
    files = _repo_files()
    dirs = {p.as_posix() for f in files for p in Path(f).parents}
    bare_dir = name.endswith("/") and name.count("/") == 1
    name = name.rstrip("/")
    if bare_dir and any(d.rsplit("/", 1)[-1] == name for d in dirs):
        return True
    for base in (ROOT, doc.parent, ROOT / "gemma4_kv"):
        full = Path(base, name).resolve()
        if not full.is_relative_to(ROOT):
            continue  # outside the repository: no file of it
        p = full.relative_to(ROOT).as_posix()
        if "*" in p:
            if any(Path(f).match(p) for f in files):
                return True
        elif p in files or p in dirs:
            return True
    if "/" not in name:
        return any(Path(f).name == name for f in files)
    return any(f.endswith("/" + name) for f in _upstream_files())


def missing_paths(doc: Path, text: str | None = None) -> list[str]:
    """The names in `doc` (or in `text`, read as if it were `doc`) that name no file."""
    text = doc.read_text() if text is None else text
    return sorted({w for w in _words(text) if w not in NOT_PATHS
                   and not all(_exists(x, doc) for x in _expand(w))})


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(doc):
    assert missing_paths(doc) == []


def test_the_check_catches_names_that_moved_away():
    """Negative control: names the documents once had, after their files moved."""
    readme = ROOT / "README.md"
    text = ("A chunk's key (`request_keys.py`); the fingerprint (`gemma4_kv/keys.py`); "
            "`bash benchmarks/run_final_gpu.sh`; see tests/test_nothing_here.py and "
            "`movers_{h200,a100}_2026-11-30.json`; `stores/server/windows.py` is real.")
    assert missing_paths(readme, text) == [
        "benchmarks/run_final_gpu.sh", "gemma4_kv/keys.py",
        "movers_{h200,a100}_2026-11-30.json", "request_keys.py",
        "tests/test_nothing_here.py"]
