"""The weights' identity: a hash of the bytes of exactly the files vLLM loads, paid once
per file version and host, in the background, and never fatal.

Oracles: sha256 of the files by hand (hashlib), vLLM's own file selection
(`DefaultModelLoader._prepare_weights`), and what a second process does while a first
one holds the host's lock.
"""

from __future__ import annotations

import contextlib
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


# -- the cache and its lock: trusted only where they are ours ---------------------------
#
# The cache maps a file's stat stamp to its sha256: whoever can write it can make one
# checkpoint's identity name another's KV, and whoever holds its lock can stall every
# engine of the host. Another uid is simulated by chown (the tests run as root).

OTHER_UID = 12345


@pytest.fixture
def weights_warnings():
    """The warnings weights.py logs (vLLM's logger does not propagate to caplog's)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    handler = Keep()
    weights.logger.addHandler(handler)
    yield records
    weights.logger.removeHandler(handler)


def _stamp_of(f: Path) -> list[int]:
    """The cache's key of a file version: (device, inode, ctime, size) of its real path."""
    st = os.stat(os.path.realpath(f))
    return [st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size]


def _forged_cache(cache: Path, victim: Path, impostor: Path) -> Path:
    """A cache file (ours, 0600, in a 0700 directory) whose entry for `victim` carries its
    current stamp and `impostor`'s digest: what the review's other uid wrote."""
    cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    entry = [_stamp_of(victim), hashlib.sha256(impostor.read_bytes()).hexdigest()]
    cache.write_text(json.dumps({"version": 1,
                                 "files": {os.path.realpath(victim): entry}}))
    cache.chmod(0o600)
    return cache


@pytest.fixture
def two_checkpoints(tmp_path):
    a = _checkpoint(tmp_path / "ckpt-a", 10.0) / "model.safetensors"
    b = _checkpoint(tmp_path / "ckpt-b", 11.0) / "model.safetensors"
    return a, b


def test_a_cache_of_our_own_is_used(two_checkpoints, digest_cache):
    """The control of the tests below: a forged entry in a cache that is ours IS read
    (the cache is trusted there), so each test below shows a refusal, not a miss."""
    a, b = two_checkpoints
    _forged_cache(digest_cache, a, b)
    assert _sig(a.parent) == _by_hand(b.parent / "model.safetensors")


def _foreign_file(cache: Path, tmp_path: Path):
    os.chown(cache, OTHER_UID, -1)


def _group_writable_file(cache: Path, tmp_path: Path):
    cache.chmod(0o620)


def _world_writable_file(cache: Path, tmp_path: Path):
    cache.chmod(0o602)


def _foreign_dir(cache: Path, tmp_path: Path):
    os.chown(cache.parent, OTHER_UID, -1)


def _group_writable_dir(cache: Path, tmp_path: Path):
    cache.parent.chmod(0o770)


def _world_writable_dir(cache: Path, tmp_path: Path):
    cache.parent.chmod(0o703)


def _symlinked_file(cache: Path, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere.json"
    cache.rename(elsewhere)
    cache.symlink_to(elsewhere)


def _symlinked_dir(cache: Path, tmp_path: Path):
    real = tmp_path / "real-digests"
    cache.parent.rename(real)
    cache.parent.symlink_to(real)


UNTRUSTED = {f.__name__.strip("_"): f for f in (
    _foreign_file, _group_writable_file, _world_writable_file, _foreign_dir,
    _group_writable_dir, _world_writable_dir, _symlinked_file, _symlinked_dir)}


@pytest.mark.parametrize("how", sorted(UNTRUSTED))
def test_a_cache_not_plainly_ours_is_ignored(tmp_path, two_checkpoints, digest_cache,
                                             weights_warnings, how):
    """Another uid's cache file or directory, one that others may write, or a symlink:
    its entries are ignored, the file is hashed (the digest by hand), and a warning
    names the path."""
    a, b = two_checkpoints
    UNTRUSTED[how](_forged_cache(digest_cache, a, b), tmp_path)
    assert _sig(a.parent) == _by_hand(a)
    assert any(str(digest_cache.parent) in w for w in weights_warnings), weights_warnings


def test_a_symlinked_lock_is_refused(tmp_path, digest_cache, weights_warnings):
    """The lock file a symlink: neither followed (its target is not created) nor taken;
    the digest is computed all the same."""
    f = _checkpoint(tmp_path / "ckpt", 12.0) / "model.safetensors"
    digest_cache.parent.mkdir(mode=0o700, parents=True)
    target = tmp_path / "not-to-be-created"
    (digest_cache.parent / "weight-digests.lock").symlink_to(target)
    assert _sig(f.parent) == _by_hand(f)
    assert not target.exists() and not target.is_symlink()
    assert any("weight-digests.lock" in w for w in weights_warnings), weights_warnings


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(3600)
"""


def test_a_lock_held_elsewhere_delays_start_a_bounded_time(tmp_path, digest_cache,
                                                           weights_warnings, monkeypatch):
    """Another process holds the host's lock and never lets go: the digest still comes
    (computed here, the cache left to the lock's holder), with one warning naming the
    lock, while that process still holds it."""
    f = _checkpoint(tmp_path / "ckpt", 13.0) / "model.safetensors"
    monkeypatch.setattr(weights, "LOCK_WAIT_S", 0.5, raising=False)
    digest_cache.parent.mkdir(mode=0o700, parents=True)
    lock = digest_cache.parent / "weight-digests.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert _Lines(holder.stdout).wait_for("held", timeout=120)
        out = []
        call = threading.Thread(target=lambda: out.append(weights.WeightsDigest(
            _model(f.parent), SimpleNamespace(load_format="safetensors",
                                              download_dir=None)).result()), daemon=True)
        call.start()
        call.join(120)  # a guard for the unfixed code only: its call never returns
        assert not call.is_alive() and holder.poll() is None
    finally:
        holder.kill()
        holder.wait(60)
    assert out == [(_by_hand(f), None)]
    assert not digest_cache.exists()  # only the lock's holder writes the cache
    assert [w for w in weights_warnings if str(lock) in w] == weights_warnings
    assert len(weights_warnings) == 1, weights_warnings


@pytest.mark.parametrize("env", [
    {"HOME": None, "passwd": False},
    {"HOME": "relative/home"},
    {"HOME": None, "passwd": False, "XDG_CACHE_HOME": "relative/cache"},
    {"GEMMA4_KV_CACHE_DIR": "relative/digests"},
], ids=["no-home-no-passwd", "relative-home", "relative-xdg", "relative-cache-dir"])
def test_no_relative_cache_path(tmp_path, monkeypatch, weights_warnings, env):
    """No absolute home, XDG cache or cache directory: the digest is computed and
    nothing is cached or created under the working directory (no `./~/.cache`)."""
    import pwd

    f = _checkpoint(tmp_path / "ckpt", 14.0) / "model.safetensors"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for var in ("HOME", "XDG_CACHE_HOME", "GEMMA4_KV_CACHE_DIR"):
        if env.get(var) is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, env[var])
    if env.get("passwd") is False:
        def no_entry(uid):
            raise KeyError(f"getpwuid(): uid not found: {uid}")

        monkeypatch.setattr(pwd, "getpwuid", no_entry)
        assert not os.path.isabs(os.path.expanduser("~"))
    assert _sig(f.parent) == _by_hand(f)
    assert _sig(f.parent) == _by_hand(f)  # again: still nothing made under the cwd
    assert os.listdir(cwd) == []
    assert weights_warnings and all("GEMMA4_KV_CACHE_DIR" in w for w in weights_warnings)


def test_a_fifo_among_the_weight_files_does_not_stall_the_digest(tmp_path):
    """A named pipe matched by `*.safetensors`: opening it would wait for a writer
    forever; the digest names it and the fix instead."""
    d = _checkpoint(tmp_path / "ckpt", 15.0)
    os.mkfifo(d / "model-2.safetensors")
    out = []
    call = threading.Thread(target=lambda: out.append(weights.WeightsDigest(
        _model(d), SimpleNamespace(load_format="safetensors", download_dir=None)).result()),
        daemon=True)
    call.start()
    call.join(120)  # a guard for the unfixed code only: its open never returns
    try:
        assert not call.is_alive()
    finally:
        with contextlib.suppress(OSError):  # a writer lets a stalled open go
            os.close(os.open(d / "model-2.safetensors", os.O_WRONLY | os.O_NONBLOCK))
    [(sig, unsafe)] = out
    assert sig is None and str(d / "model-2.safetensors") in unsafe and "weights_id" in unsafe
