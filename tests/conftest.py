"""Test set-up: Triton kernels run under the interpreter on machines without a GPU;
tests marked `cuda` are skipped without one (in CI too: CI has no GPU; a missing vLLM
or LMCache is a failure there instead, tests/needs.py); no test may leave vLLM's
engines switched to in-process for the rest of the run."""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

os.environ.setdefault("PYTHONHASHSEED", "0")
# No engine of the run reads or writes this user's persisted lookup rates
# (gemma4_kv/lookup/rate_file.py): an earlier run's, or another module's, measurements
# would change how long a test's first lookup waits. tests/test_priors.py tests the file.
os.environ.setdefault("GEMMA4_KV_RATES_FILE", "off")
if not _HAS_CUDA:
    # Must be set before any @triton.jit function is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Every process this run starts (engines, benchmarks, servers) gets one OpenMP
    # thread. vLLM's CPU worker binds its compute to one core (tests/e2e_common.py
    # `Cores`), but an OpenMP pool created before that binding keeps a second thread
    # that spins after each parallel region on the same core: two tiny engines side by
    # side took 43 s for 27 prefills with it and 12 s without. This process keeps its
    # own pool (torch is imported above), so engine-free tests still use both cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM sets it to 0 in os.environ when it builds an external_launcher ParallelConfig;
every engine started from this process afterwards (the harness inherits os.environ)
would then run its engine core and worker inside the harness process."""


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip)
    items.sort(key=_engine_group)  # stable: the order within each group stays


_skips: list[tuple[str, str]] = []  # (test id, reason) of every skip in this run


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        _skips.append((report.nodeid, reason[len("Skipped: "):]
                       if reason.startswith("Skipped: ") else reason))


def pytest_terminal_summary(terminalreporter):
    """The run's skips by reason; under CI=true a skip not in tests/intended_skips.py
    fails the run."""
    from collections import Counter

    from intended_skips import unexpected
    from needs import in_ci

    _report_timeline(terminalreporter)
    if not _skips:
        return
    tr = terminalreporter
    tr.section("skips by reason")
    for reason, n in Counter(r for _, r in _skips).most_common():
        tr.write_line(f"{n:5d}  {reason}")
    bad = unexpected([r for _, r in _skips])
    if bad and in_ci():
        tr.write_line("skips not in tests/intended_skips.py (a failure under CI=true):",
                      red=True)
        for test, reason in _skips:
            if reason in bad:
                tr.write_line(f"  {test}: {reason}", red=True)


def pytest_sessionfinish(session, exitstatus):
    from intended_skips import unexpected
    from needs import in_ci

    if in_ci() and unexpected([r for _, r in _skips]) and exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _engines_stay_out_of_process():
    """Fail (and undo) a test that changes VLLM_ENABLE_V1_MULTIPROCESSING in os.environ."""
    before = os.environ.get(MP_ENV)
    yield
    after = os.environ.get(MP_ENV)
    if after != before:
        if before is None:
            os.environ.pop(MP_ENV, None)
        else:
            os.environ[MP_ENV] = before
        pytest.fail(f"the test left {MP_ENV}={after!r} in os.environ (before: {before!r}): "
                    "later engines of this run would run in-process; restore it "
                    "(monkeypatch.setenv)", pytrace=False)


# -- engines: one vLLM cache for the run, a pool, and the modules run alone ---------------
BESIDE_ENGINES = frozenset({
    "test_architecture", "test_capacity", "test_connector_config", "test_drafts",
    "test_engine_identity", "test_hf_layout", "test_integrity", "test_layout_vllm",
    "test_lmcache_format", "test_mover", "test_needs", "test_plan", "test_request_keys",
    "test_tier_sim", "test_warmup", "test_weights_identity"})
"""Modules that start no engine and wait for no thread, server or timeout of the
connector: they run while the engine pool's first jobs start, on the core those jobs
leave (most of these tests use one)."""


def _engine_group(item) -> int:
    """Order of the test run: tests that start no engine and meet the connector's own
    short timeouts (a rank's answer, an L2 wait, a server's), alone; those that meet
    none (`BESIDE_ENGINES`), while the engine pool starts; the modules whose engines run
    side by side (`engine_jobs`); the modules whose steps run alone (`start_engines`):
    their faults meet those timeouts, and an engine computing beside them could make a
    lookup outlast one and change an exact hit."""
    mod = item.module
    if hasattr(mod, "engine_jobs"):
        return 2
    if hasattr(mod, "start_engines"):
        return 3
    return 1 if mod.__name__ in BESIDE_ENGINES else 0


@pytest.fixture(autouse=True)
def _engines_start_beside(request):
    """The first test of a `BESIDE_ENGINES` module starts the engine pool (its jobs)."""
    if _engine_group(request.node) == 1:
        request.getfixturevalue("engine_pool")


@pytest.fixture(scope="session", autouse=True)
def _vllm_cache_root(tmp_path_factory):
    """One vLLM cache (VLLM_CACHE_ROOT) for every engine of this run: vLLM inspects a
    model class in a subprocess of its own (~10 s) unless its cache has the answer."""
    before = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm-cache", numbered=False))
    yield os.environ["VLLM_CACHE_ROOT"]
    if before is None:
        os.environ.pop("VLLM_CACHE_ROOT", None)
    else:
        os.environ["VLLM_CACHE_ROOT"] = before


@pytest.fixture(scope="session")
def engine_pool(request, tmp_path_factory):
    """Every engine of the selected tests, started on first use: the jobs of the modules
    that run side by side (`engine_jobs(tmp_path_factory, selected)`: [(key, seconds, job[,
    memory units])]; `selected`: the names of the module's selected tests, with and
    without parameters) side by side, longest first; the engines of the modules run alone
    (`start_engines(tmp_path_factory, selected)`: their state, engines waiting at their
    gates) when the module first asks, once every pool job has finished, one module at
    a time (the previous one's engines closed), so nothing else runs beside its
    steps."""
    from e2e_common import EnginePool, pool_slots

    selected: dict = {}
    for item in request.session.items:
        if "engine_pool" in item.fixturenames and _engine_group(item) >= 2:
            selected.setdefault(item.module, set()).update({item.originalname, item.name})
    jobs, lazy = [], {}
    for mod, names in selected.items():
        if hasattr(mod, "engine_jobs"):
            for key, cost, fn, *units in mod.engine_jobs(tmp_path_factory, names):
                jobs.append((cost, (mod.__name__, key), fn, units[0] if units else 1))
        else:
            lazy[(mod.__name__, "start")] = \
                lambda mod=mod, names=names: mod.start_engines(tmp_path_factory, names)
    _resolve_lazy_imports()
    pool = EnginePool(pool_slots())
    for _, key, fn, units in sorted(jobs, key=lambda j: -j[0]):
        pool.submit(key, fn, units)
    for key, fn in lazy.items():
        pool.later(key, fn)
    yield pool
    pool.close()
    _timeline.extend((str(k), a - pool.created, b - pool.created) for k, a, b in pool.timeline)
    from engine_zygote import ZYGOTE

    _engines.update(forked=ZYGOTE.forked, spawned=ZYGOTE.spawned, why=sorted(ZYGOTE.why))


def _resolve_lazy_imports() -> None:
    """Import, on this thread, the transformers classes pool jobs build configs from
    (tiny_gemma4_config, e2e_common's MTP assistant, eagle_draft's Llama draft).
    transformers' lazy module is not thread-safe: two jobs that first touch
    `transformers.Gemma4TextConfig` at once can see the half-imported module and fail
    with "module 'transformers' has no attribute 'Gemma4TextConfig'"."""
    import transformers

    for name in ("Gemma4TextConfig", "Gemma4AssistantConfig", "LlamaConfig"):
        getattr(transformers, name)


_timeline: list[tuple[str, float, float]] = []  # engine pool jobs: (key, start, end) in s
_engines: dict = {}  # harness engines forked from the zygote / started afresh, and why


def _report_timeline(tr) -> None:
    """When each engine pool job ran (seconds since the pool started): where CI's
    minutes go."""
    if not _timeline:
        return
    tr.section("engine pool jobs (s from the pool's start)")
    tr.write_line(f"harness engines: {_engines.get('forked', 0)} forked from the zygote, "
                  f"{_engines.get('spawned', 0)} started afresh {_engines.get('why') or ''}")
    for key, a, b in sorted(_timeline, key=lambda t: t[1]):
        tr.write_line(f"{a:7.0f} {b:7.0f} {b - a:6.0f}  {key}")
