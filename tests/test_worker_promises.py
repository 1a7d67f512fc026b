"""What the README promises of a worker rank, through the connector's real worker half
(`Gemma4KVConnector` in vLLM's WORKER role: `register_kv_caches` on vLLM-shaped CPU KV
tensors, its real key derivation, store and lookup socket) paired with the real
scheduler half (tests/scheduler_half.py) in this process, vLLM's distributed state
set up for one rank over gloo."""

from __future__ import annotations

import random
import socket

import pytest

from needs import require
from scheduler_half import SchedulerHalf, engine_configs

require("vllm")
pytestmark = pytest.mark.vllm

_rng = random.Random(26)
PROMPT = [_rng.randrange(3, 500) for _ in range(1100)]
HIT = 1024  # 4 full chunks of 256; the prompt's last token is computed by vLLM


@pytest.fixture(scope="module")
def one_rank():
    """vLLM's world and tensor-parallel group of one rank (the worker half asks its
    rank), torn down afterwards."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (destroy_distributed_environment,
                                                 destroy_model_parallel,
                                                 ensure_model_parallel_initialized,
                                                 init_distributed_environment)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

    return save_config(tiny_gemma4_config(window=100), tmp_path_factory.mktemp("model"))


def worker_for(vc, kv_cache_config):
    """A worker-role connector over vLLM-shaped KV tensors of `kv_cache_config`, its
    attention layers in vLLM's forward context (what the model builds) and its caches
    registered: vLLM's order at start-up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.model_executor.layers.attention.attention import Attention

    from gemma4_kv.connector import Gemma4KVConnector
    from paged import make_paged

    # The worker runs in this process, as in the engine core under the uni executor
    # (vLLM's CPU platform picks mp for a config built outside an engine).
    vc.parallel_config.distributed_executor_backend = "uni"
    kv_caches = {}
    with set_current_vllm_config(vc):
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            for name in group.layer_names:
                Attention(spec.num_kv_heads, spec.head_size, 1.0,
                          num_kv_heads=spec.num_kv_heads, cache_config=vc.cache_config,
                          prefix=name)
            tensors = make_paged(len(group.layer_names), kv_cache_config.num_blocks,
                                 spec.num_kv_heads, spec.block_size, spec.head_size,
                                 spec.dtype, layout="LBHNC")
            kv_caches.update(zip(group.layer_names, tensors))
        connector = Gemma4KVConnector(vc, KVConnectorRole.WORKER, kv_cache_config)
        connector.register_kv_caches(kv_caches)
    return connector


def run_step(worker, meta) -> None:
    """The worker's part of one step, in vLLM's order (the forward between the load and
    the save)."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.get_finished(set())
    worker.clear_connector_metadata()


# -- "weights that cannot be hashed ... the engine serves with nothing stored or loaded" --

@pytest.mark.parametrize("weights_id", [None, "ckpt-1"])
def test_a_worker_that_cannot_key_its_kv_stores_and_serves_nothing(one_rank, model,
                                                                   weights_id, caplog):
    """load_format "safetensors" over a directory without weight files: the worker
    cannot name the weights vLLM loads (the real digest fails), so its fingerprint is
    unsafe; the scheduler half cannot see that and asks to save the prompt's chunks,
    yet the rank writes nothing and answers every lookup with a miss. With
    `weights_id` set (the README's fix) the same steps store 4 chunks and hit 1024."""
    from vllm.v1.core.sched.output import SchedulerOutput

    extra = {} if weights_id is None else {"weights_id": weights_id}
    half = SchedulerHalf(model, ranks=1, serve_ranks=False, extra=extra,
                         engine={"load_format": "safetensors"})
    with caplog.at_level("WARNING", logger="gemma4_kv"):
        worker = worker_for(half.vllm_config, half.kv_cache_config)
    cw = worker._worker
    try:
        assert cw.enabled is (weights_id is not None)
        warned = [r.getMessage() for r in caplog.records
                  if "cannot be keyed safely" in r.getMessage()]
        if weights_id is None:  # one warning naming the cause and the fix
            assert len(warned) == 1 and "no weight file" in warned[0]
            assert 'set kv_connector_extra_config["weights_id"]' in warned[0]
        else:
            assert warned == []
        first = half.request(PROMPT)
        hit, meta = half.schedule(first)
        assert hit == 0 and meta.saves  # the scheduler half asks for the chunks
        run_step(worker, meta)
        cw.saves.wait()
        half.finish(first)
        run_step(worker, half.connector.build_connector_meta(SchedulerOutput.make_empty()))
        stored = worker.get_kv_connector_stats().data.get("save_blocks", 0)
        again = half.request(PROMPT)
        hit, meta = half.schedule(again)
        run_step(worker, meta)
        half.finish(again)
        if weights_id is None:
            assert (stored, cw.store.usage()[0], hit) == (0, 0, 0)
        else:
            assert stored > 0 and cw.store.usage()[0] > 0 and hit == HIT
        assert cw.lookups.pinned_requests() == set()
    finally:
        worker.shutdown()
        half.close()


# -- "Start-up fails naming the key if the server does not answer" ------------------------

def test_an_unusable_lmcache_server_stops_start_up_naming_the_key_and_the_fix(one_rank,
                                                                            model):
    """Something accepts connections at the `lmcache_server` address but is no
    `lmcache server`: the worker's `register_kv_caches` (where the store opens) raises
    a SettingsError naming the key and the fix, not LMCache's own exception."""
    from gemma4_kv.config.settings import SettingsError

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        vc, kv_cache_config = engine_configs(
            model, {"lmcache_server": url, "lmcache_server_timeout_s": 0.5})
        with pytest.raises(SettingsError) as err:
            worker_for(vc, kv_cache_config)
    msg = str(err.value)
    assert 'kv_connector_extra_config["lmcache_server"]' in msg
    assert "fix: start the README's `lmcache server` command line" in msg
