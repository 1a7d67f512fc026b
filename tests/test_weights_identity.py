"""The weights' identity: a hash of the bytes of exactly the files vLLM loads, paid once
per file version and host, in the background, and never fatal.

Oracles: sha256 of the files by hand (hashlib), vLLM's own file selection
(`DefaultModelLoader._prepare_weights`), and what a second process does while a first
one holds the host's lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from needs import require

require("vllm")

from gemma4_kv.keys import weights  # noqa: E402
from gemma4_kv.keys.weights import WeightsError, weights_signature  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_KV_CACHE_DIR", str(tmp_path / "digests"))
    return tmp_path / "digests" / "weight-digests.json"


def _model(path, revision=None):
    """What weights.py reads of vLLM's ModelConfig, for a directory or a hub id."""
    return SimpleNamespace(model=str(path), model_weights="", revision=revision,
                           architectures=["Gemma4ForCausalLM"], model_impl="auto",
                           convert_type="none")


def _sig(path, load_format="safetensors", download_dir=None, revision=None):
    return weights_signature(_model(path, revision),
                             SimpleNamespace(load_format=load_format,
                                             download_dir=download_dir))


def _checkpoint(d, value: float, name="model.safetensors"):
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    save_file({"w": torch.full((1024,), value)}, str(d / name))
    return d


def _by_hand(*files) -> str:
    """sha256 over "name\\0<sha256 of the bytes>\\n" per file after the format line."""
    h = hashlib.sha256(b"gemma4-kv:weights:1\n")
    for f in sorted(files):
        h.update(f"{f.name}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return f"content:{len(files)}:{h.hexdigest()}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

    return save_config(tiny_gemma4_config(), tmp_path_factory.mktemp("model"))


def _engine_config(model_dir, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                dtype="float32", max_model_len=2048)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


# -- what is hashed -------------------------------------------------------------------

def test_weights_identity_is_the_files_content(tmp_path, model_dir, digest_cache):
    d = tmp_path / "ckpt"
    shutil.copytree(model_dir, d)
    cfg = _engine_config(d)
    assert weights_signature(cfg.model_config, cfg.load_config) == "dummy"
    f = _checkpoint(d, 0.0) / "model.safetensors"
    cfg = _engine_config(d, load_format="safetensors")
    first = weights_signature(cfg.model_config, cfg.load_config)
    assert first == _by_hand(f) and _sig(d) == first
    assert _sig(shutil.copytree(d, tmp_path / "copy")) == first  # a copy elsewhere agrees
    st = os.stat(f)
    _checkpoint(d, 1.0)  # rewritten in place, then size and mtime put back (cp -p, rsync -a)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_size == st.st_size and os.stat(f).st_mtime_ns == st.st_mtime_ns
    assert _sig(d) != first
    _checkpoint(d, 0.0)
    assert _sig(d) == first


def test_files_vllm_never_loads_are_not_hashed(tmp_path, digest_cache):
    """Trainer state beside a checkpoint (optimizer, scheduler, training args) and a
    second format vLLM skips once safetensors exist: neither read nor keyed."""
    d = _checkpoint(tmp_path / "ckpt", 3.0)
    st = d / "model.safetensors"
    for name in ("optimizer.pt", "scheduler.pt", "training_args.bin", "pytorch_model.bin"):
        (d / name).write_bytes(os.urandom(4096))
    first = _sig(d, "auto")
    assert first == _by_hand(st)
    (d / "optimizer.pt").write_bytes(os.urandom(4096))  # the next training step
    (d / "training_args.bin").write_bytes(b"other")
    assert _sig(d, "auto") == first
    # Without safetensors vLLM loads the .bin files, minus the trainer's.
    st.unlink()
    assert _sig(d, "auto") == _by_hand(d / "pytorch_model.bin")


def _layout(d, files: dict[str, bytes | dict]):
    d.mkdir(parents=True)
    for name, body in files.items():
        (d / name).write_bytes(json.dumps(body).encode() if isinstance(body, dict) else body)
    return d


LAYOUTS = {
    "safetensors+bin+trainer": {"model.safetensors": b"s", "pytorch_model.bin": b"b",
                                "optimizer.pt": b"o", "training_args.bin": b"t"},
    "bin+trainer": {"pytorch_model-00001.bin": b"1", "pytorch_model-00002.bin": b"2",
                    "optimizer.bin": b"o", "training_args.bin": b"t", "extra.pt": b"p"},
    "pt only": {"model.pt": b"p", "scaler.pt": b"s"},
    "shards+index+consolidated": {
        "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
        "consolidated.safetensors": b"c",
        "model.safetensors.index.json": {"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}},
    "shards+index+stray": {
        "model-00001-of-00001.safetensors": b"1", "old-model.safetensors": b"x",
        "model.safetensors.index.json": {"weight_map": {"a": "model-00001-of-00001.safetensors"}}},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("load_format", ["auto", "hf", "safetensors", "pt", "mistral",
                                         "npcache"])
def test_file_selection_is_vllms(tmp_path, layout, load_format):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    d = _layout(tmp_path / "ckpt", LAYOUTS[layout])
    try:
        _, want, _, _ = DefaultModelLoader(LoadConfig(load_format=load_format))._prepare_weights(
            str(d), None, None, True, None)
    except RuntimeError as e:  # vLLM finds nothing to load
        assert "Cannot find any model weights" in str(e)
        with pytest.raises(WeightsError, match="weights_id"):
            weights.loaded_files(_model(d), SimpleNamespace(load_format=load_format))
        return
    assert weights.loaded_files(_model(d), SimpleNamespace(load_format=load_format)) == \
        sorted(want)


def test_weight_digests_are_cached_per_file_version(tmp_path, digest_cache, monkeypatch):
    d = _checkpoint(tmp_path / "ckpt", 2.0)
    reads = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, a: reads.append(f.name) or real(f, a))
    first = _sig(d)
    assert len(reads) == 1 and json.loads(digest_cache.read_text())["version"] == 1
    assert _sig(d) == first and len(reads) == 1  # a restart: the cache, no read
    os.chmod(d / "model.safetensors", 0o644)  # metadata only: ctime moves, hashed again
    assert _sig(d) == first and len(reads) == 2


def _hub_snapshot(cache_dir, repo: str, value: float, commit: str):
    """A Hugging Face cache entry as huggingface_hub lays it out: refs/main names the
    commit, snapshots/<commit>/ holds the files."""
    base = cache_dir / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    _checkpoint(base / "snapshots" / commit, value)
    (base / "snapshots" / commit / "config.json").write_text("{}")


def test_a_hub_id_resolves_through_vllms_download_dir(tmp_path, digest_cache, monkeypatch):
    """An older snapshot in the default HF cache and the one vLLM loads, in its
    download_dir: the identity is the download_dir one's; with the model nowhere on
    this machine, the reason names the fix."""
    repo = "org/tiny-gemma4"
    default, downloads = tmp_path / "hf-default", tmp_path / "downloads"
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(default))  # read at each call
    _hub_snapshot(default, repo, 1.0, "a" * 40)
    _hub_snapshot(downloads, repo, 2.0, "b" * 40)
    loaded = _sig(downloads / f"models--org--tiny-gemma4/snapshots/{'b' * 40}")
    old = _sig(default / f"models--org--tiny-gemma4/snapshots/{'a' * 40}")
    assert loaded != old
    assert _sig(repo, download_dir=str(downloads)) == loaded
    assert _sig(repo) == old  # no download_dir: vLLM loads from the default cache
    with pytest.raises(WeightsError, match=r"not on this machine.*weights_id"):
        _sig(repo, download_dir=str(tmp_path / "empty"))


# -- once per host, in the background ---------------------------------------------------

class _HostLock:
    """The host's hashing lock, held by this test as another engine would hold it."""

    def __init__(self, cache: Path):
        cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd = os.open(cache.parent / "weight-digests.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Lines:
    """A child's stream, read on a thread of its own: the test waits for a line up to a
    deadline, never on a read that returns only when the child writes or ends."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.closed = False
        self._new = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream):
        for line in stream:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self.closed = True
            self._new.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        """True once a line holds `text`; False when the stream ends or time is up."""
        def seen():
            return any(text in line for line in self.lines)

        with self._new:
            self._new.wait_for(lambda: self.closed or seen(), timeout)
            return seen()

    def text(self, timeout: float) -> str:
        self._reader.join(timeout)
        with self._new:
            return "".join(self.lines)


HASHER = """
import logging, sys
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from gemma4_kv.keys import weights
from gemma4_kv.keys.weights import weights_signature
weights.LOCK_WAIT_S = 300  # waiting for the test's lock is the point here, not its bound
m = SimpleNamespace(model=sys.argv[1], model_weights="", revision=None,
                    architectures=["Gemma4ForCausalLM"], model_impl="auto", convert_type="none")
# sharded_state: every *.safetensors, chosen without importing vLLM (a quick start)
print(weights_signature(m, SimpleNamespace(load_format="sharded_state", download_dir=None)),
      flush=True)
"""


def test_engines_of_one_host_hash_once(tmp_path, digest_cache):
    """Two processes start while a third holds the host's lock: both wait for it; then
    one hashes and the other reads what it cached."""
    d = _checkpoint(_checkpoint(tmp_path / "ckpt", 4.0, "model-1.safetensors"), 5.0,
                    "model-2.safetensors")
    want = _by_hand(d / "model-1.safetensors", d / "model-2.safetensors")
    env = {**os.environ, "GEMMA4_KV_CACHE_DIR": str(digest_cache.parent),
           "PYTHONPATH": str(ROOT)}
    lock = _HostLock(digest_cache)
    procs, errs = [], []
    try:
        for _ in range(2):
            procs.append(subprocess.Popen([sys.executable, "-c", HASHER, str(d)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
            errs.append(_Lines(procs[-1].stderr))
        for err in errs:  # each says it waits (or ends without having waited)
            assert err.wait_for("waiting for another process", timeout=300), err.text(0)
    finally:
        lock.release()
        for p in procs:
            try:
                p.wait(timeout=300)
            finally:
                p.kill()
    outs = [(p.stdout.read(), err.text(60)) for p, err in zip(procs, errs)]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.split() for out, _ in outs] == [[want], [want]]
    hashed = ["gemma4-kv: hashing 2 weight file(s)" in err for _, err in outs]
    assert sorted(hashed) == [False, True], outs  # one read the other's digests


def test_hashing_starts_in_the_background_from_vllms_first_call(tmp_path, digest_cache,
                                                                  model_dir):
    """vLLM asks the connector for a KV layout in the engine core before it profiles the
    model: that call returns at once, with the weights hashing beside it; the worker's
    `take` waits for that digest."""
    from vllm.config import KVTransferConfig

    from gemma4_kv.connector import Gemma4KVConnector

    d = shutil.copytree(model_dir, tmp_path / "ckpt")
    _checkpoint(d, 6.0)
    cfg = _engine_config(d, load_format="safetensors", kv_transfer_config=KVTransferConfig(
        kv_connector="Gemma4KVConnector", kv_connector_module_path="gemma4_kv.connector",
        kv_role="kv_both"))
    waiting = threading.Event()

    class Waits(logging.Handler):
        def emit(self, record):
            if "waiting for another process" in record.getMessage():
                waiting.set()

    handler = Waits()
    weights.logger.addHandler(handler)
    level = weights.logger.level
    weights.logger.setLevel(logging.INFO)
    lock = _HostLock(digest_cache)
    try:
        assert Gemma4KVConnector.get_required_kvcache_layout(cfg) is None
        assert waiting.wait(120)  # the hash runs on, in a thread of its own
        digest = weights.take(cfg.model_config, cfg.load_config)
        assert digest.running
    finally:
        lock.release()
        weights.logger.removeHandler(handler)
        weights.logger.setLevel(level)
    assert digest.result() == (_by_hand(d / "model.safetensors"), None)


# -- never fatal ------------------------------------------------------------------------

def test_an_unreadable_file_makes_the_engine_uncacheable(tmp_path, digest_cache, model_dir):
    """A weight file that cannot be read: the digest names it and the fix, the worker's
    fingerprint is unsafe (nothing stored or loaded), nothing raises."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    from gemma4_kv.keys.engine import store_fingerprint
    from gemma4_kv.layout.from_hf import hf_layout
    from gemma4_kv.tools.harness import tiny_gemma4_config

    d = shutil.copytree(model_dir, tmp_path / "ckpt")
    _checkpoint(d, 7.0)
    (d / "model-2.safetensors").mkdir()  # matched by *.safetensors, cannot be read
    cfg = _engine_config(d, load_format="safetensors")
    sig, unsafe = weights.WeightsDigest(cfg.model_config, cfg.load_config).result()
    assert sig is None
    assert str(d / "model-2.safetensors") in unsafe and '"weights_id"' in unsafe
    layout = hf_layout(tiny_gemma4_config(), dtype=torch.float32, block_size=32)
    with set_current_vllm_config(cfg):
        for g in layout.groups:
            for name in g.layers:
                Attention(g.num_kv_heads, g.head_size, 1.0, num_kv_heads=g.num_kv_heads,
                          cache_config=cfg.cache_config, prefix=name)

    def fingerprint(**kw):
        return store_fingerprint(cfg, layout, kv_cache_layout="LBHNC", chunk_size=256,
                                 device=torch.device("cpu"), tp_rank=0, tp_size=1, **kw)

    assert fingerprint().unsafe == unsafe
    assert fingerprint(weights_id="ckpt-7").unsafe is None  # the fix works


def test_a_file_touched_while_hashed_is_read_again(tmp_path, digest_cache, monkeypatch):
    """`touch`, `chmod` or a new hard link during the read moves ctime: read again, and
    if it never holds still, the engine only caches nothing."""
    d = _checkpoint(tmp_path / "ckpt", 8.0)
    f = d / "model.safetensors"
    real, calls = hashlib.file_digest, []

    def touched(fh, algo, every=False):
        calls.append(1)
        out = real(fh, algo)
        if every or len(calls) == 1:
            os.link(f, d / f"link-{len(calls)}")  # a new hard link: ctime moves
        return out

    monkeypatch.setattr(hashlib, "file_digest", touched)
    assert _sig(d) == _by_hand(f) and len(calls) == 2
    monkeypatch.setattr(hashlib, "file_digest", lambda fh, a: touched(fh, a, every=True))
    f.write_bytes(f.read_bytes())  # a new version: not cached
    sig, unsafe = weights.WeightsDigest(_model(d), SimpleNamespace(
        load_format="safetensors", download_dir=None)).result()
    assert sig is None and "kept changing" in unsafe and str(f) in unsafe


def test_a_load_format_without_known_files_is_uncacheable(tmp_path):
    d = _checkpoint(tmp_path / "ckpt", 9.0)
    sig, unsafe = weights.WeightsDigest(_model(d), SimpleNamespace(
        load_format="tensorizer", download_dir=None)).result()
    assert sig is None and "tensorizer" in unsafe and "weights_id" in unsafe
