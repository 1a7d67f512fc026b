"""What the connector tells vLLM about itself: piecewise CUDA graphs (through vLLM's own
config resolution) and transfer metrics (vLLM's KVConnectorStats and Prometheus types)."""

from __future__ import annotations

import pickle

from needs import require

require("vllm")

from gemma4_kv.connector import Gemma4KVConnector  # noqa: E402
from gemma4_kv.connector.metrics import COUNTERS, Gemma4KVStats  # noqa: E402


def resolved_cudagraph_mode(monkeypatch, **ktc):
    """vLLM's own resolution of cudagraph_mode FULL_AND_PIECEWISE with a connector, on a
    platform that supports CUDA graphs (this CPU machine says it does not)."""
    from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "support_static_graph_mode",
                        classmethod(lambda cls: True))
    config = VllmConfig(compilation_config=CompilationConfig(
        cudagraph_mode="FULL_AND_PIECEWISE"), kv_transfer_config=KVTransferConfig(**ktc))
    return config.compilation_config.cudagraph_mode


def test_vllm_runs_piecewise_graphs_with_this_connector(monkeypatch, caplog):
    """Layer-by-layer loads need `wait_for_layer_load`, which a full CUDA graph replays
    without calling: vLLM must not run full graphs with this connector."""
    assert Gemma4KVConnector.requires_piecewise_for_cudagraph({}) is True
    mode = resolved_cudagraph_mode(monkeypatch, kv_connector="Gemma4KVConnector",
                                   kv_connector_module_path="gemma4_kv.connector",
                                   kv_role="kv_both")
    assert not mode.has_full_cudagraphs()
    # control: a connector that does not ask keeps full graphs
    control = resolved_cudagraph_mode(monkeypatch, kv_connector="ExampleConnector",
                                      kv_role="kv_both")
    assert control.has_full_cudagraphs()


def test_stats_sum_over_ranks_and_survive_the_trip_to_the_front_end():
    a, b = Gemma4KVStats(), Gemma4KVStats()
    a.add("load_bytes", 3e9, group=5)
    a.add("load_seconds", 0.5)
    a.lookup(1024, 256, 0.002)
    b.add("load_bytes", 1e9, group=0)
    b.add("load_seconds", 0.5)
    b.add("rejected_objects", 2)
    total = a.take().aggregate(pickle.loads(pickle.dumps(b.take())))
    assert a.take() is None and b.is_empty()  # an interval's counters go once
    rebuilt = Gemma4KVConnector.build_kv_connector_stats(total.to_dict())
    line = rebuilt.reduce()
    assert line["load_GB"] == 4.0 and line["load_GB_per_s"] == 4.0
    assert line["hit_tokens"] == 1024 and line["hit_tokens_l2"] == 256
    assert line["rejected_objects"] == 2 and line["lookups"] == 1
    assert rebuilt.data["load_bytes.g5"] == 3e9 and rebuilt.data["load_bytes.g0"] == 1e9
    assert Gemma4KVConnector.build_kv_connector_stats(None).is_empty()


def test_prometheus_counters_follow_the_stats():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *args, **kw):
                super().__init__(*args, registry=registry, **kw)
        return Bound

    from vllm.config import VllmConfig

    prom = Gemma4KVConnector.build_prom_metrics(
        VllmConfig(), {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)},
        ["engine"], {0: ["0"]})
    prom.observe({"load_bytes": 5.0, "lookups": 2, "rejected_objects": 1}, engine_idx=0)
    prom.observe({"load_bytes": 1.0}, engine_idx=0)
    value = registry.get_sample_value
    assert value("vllm:gemma4_kv_load_bytes_total", {"engine": "0"}) == 6.0
    assert value("vllm:gemma4_kv_lookups_total", {"engine": "0"}) == 2.0
    assert value("vllm:gemma4_kv_rejected_objects_total", {"engine": "0"}) == 1.0
    assert {f"vllm:gemma4_kv_{n}_total" for n in COUNTERS} <= {
        s.name for m in registry.collect() for s in m.samples}


def test_the_vllm_plugin_registers_the_connector_by_name():
    """The package's `vllm.general_plugins` entry point, as vLLM loads it in each process
    (`load_general_plugins`): afterwards `kv_connector: Gemma4KVConnector` resolves with
    no `kv_connector_module_path`. (Every end-to-end engine of the harness loads the
    connector this way; the fault tests' engines load theirs by module path.)"""
    from importlib.metadata import entry_points

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_plugins_by_group

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "gemma4_kv"]
    assert ep.value == "gemma4_kv.connector.plugin:register"
    plugins = load_plugins_by_group("vllm.general_plugins")
    plugins["gemma4_kv"]()
    plugins["gemma4_kv"]()  # vLLM may load plugins more than once
    config = KVTransferConfig(kv_connector="Gemma4KVConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config) is Gemma4KVConnector
