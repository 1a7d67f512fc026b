"""kv_connector_extra_config: strict types, clear one-line errors, host checks, README table.

Adapters go through LMCache's real parser; tier checks connect to real sockets.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import psutil
import pytest

from gemma4_kv.config.host_checks import (cgroup_room, check_host_resources, check_tiers_reachable,
                                   memory_headroom)
from gemma4_kv.config.readme import readme_table
from gemma4_kv.config.settings import GiB, ConnectorSettings, SettingsError

parse = ConnectorSettings.from_extra_config
README = Path(__file__).resolve().parents[1] / "README.md"
MOCK = {"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 10}


def error(extra: dict, key: str) -> str:
    """The message of the SettingsError `extra` raises; it must name `key`, say what was
    given and the fix, on one line."""
    with pytest.raises(SettingsError) as info:
        parse(extra)
    msg = str(info.value)
    assert msg.startswith(f'gemma4-kv: kv_connector_extra_config["{key}"]'), msg
    assert "\n" not in msg and ": got " in msg, msg
    assert "; fix: " in msg, msg
    return msg


# -- good values -----------------------------------------------------------------------

def test_defaults():
    s = parse(None)
    assert s == parse({}) == ConnectorSettings()
    assert (s.chunk_size, s.cpu_gb, s.disk_path, s.disk_gb, s.l2_adapters) == (256, 4, None, 0, ())
    assert (s.num_programs, s.model_id, s.stats_file) == (32, None, None)
    assert (s.lookup_timeout_s, s.retention_interval, s.staging_mb) == (2.0, 4096, 2048)
    assert s.verify_checksums is True and s.save_decode_tokens is True
    assert s.lmcache_log_level == "WARNING"


def test_good_values_round_trip(tmp_path):
    extra = {"chunk_size": 512, "cpu_gb": 8, "disk_path": str(tmp_path / "disk"),
             "disk_gb": 10.5, "l2_adapters": [MOCK], "num_programs": 1024,
             "model_id": "gemma-4-31b", "stats_file": str(tmp_path / "stats.jsonl"),
             "lookup_timeout_s": 0.5, "retention_interval": 0, "staging_mb": 16,
             "verify_checksums": False, "save_decode_tokens": False,
             "lmcache_log_level": "DEBUG"}
    s = parse(extra)
    for k, v in extra.items():
        assert getattr(s, k) == (tuple(v) if k == "l2_adapters" else v), k
    assert parse({"retention_interval": 1024, "chunk_size": 512}).retention_interval == 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.cpu_gb = 1
    extra["l2_adapters"][0]["max_size_gb"] = 99  # the caller's dicts are not aliased
    assert s.l2_adapters[0]["max_size_gb"] == 1


def test_store_config_splits_per_engine_sizes_over_ranks(tmp_path):
    s = parse({"cpu_gb": 8, "disk_path": str(tmp_path), "disk_gb": 10, "l2_adapters": [MOCK],
               "verify_checksums": False})
    one, two = s.store_config(), s.store_config(ranks=2)
    assert one.cpu_bytes == 8 * GiB and two.cpu_bytes == 4 * GiB
    assert one.disk_gb == 10 and two.disk_gb == 5
    assert one.verify_checksums is False and one.l2_adapters == (MOCK,)
    specs = one.adapter_specs()
    assert specs[0]["type"] == "fs_native" and specs[0]["base_path"] == str(tmp_path)
    assert specs[1] == MOCK
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match="ranks"):
            s.store_config(ranks=bad)


# -- the values from the issue ------------------------------------------------------------

@pytest.mark.parametrize("extra, key, says", [
    ({"cpu_gb": "4"}, "cpu_gb", ['not a string', 'got "4" (str)', "drop the quotes: 4"]),
    ({"cpu_gb": True}, "cpu_gb", ["not a boolean", "got true (bool)"]),
    ({"cpu_gb": math.nan}, "cpu_gb", ["finite", "got NaN (float)"]),
    ({"chunk_size": 256.0}, "chunk_size",
     ["must be an integer", "got 256.0 (float)", "write 256 (no decimal point)"]),
    ({"l2_adapters": "resp"}, "l2_adapters", ["not a string", 'got "resp" (str)']),
])
def test_issue_values(extra, key, says):
    msg = error(extra, key)
    for s in says:
        assert s in msg, (s, msg)


def test_bool_is_not_an_int_and_an_int_is_not_a_bool():
    for key in ("chunk_size", "num_programs", "retention_interval", "staging_mb"):
        assert "not a boolean" in error({key: True}, key)
    for key in ("cpu_gb", "disk_gb", "lookup_timeout_s"):
        assert "not a boolean" in error({key: False}, key)
    for key in ("verify_checksums", "save_decode_tokens"):
        assert "write true or false" in error({key: 1}, key)
        assert "drop the quotes: false" in error({key: "False"}, key)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("key", ["cpu_gb", "disk_gb", "lookup_timeout_s"])
def test_non_finite_numbers(key, value):
    assert "finite" in error({key: value}, key)


@pytest.mark.parametrize("extra, key, says", [
    ({"chunk_size": 0}, "chunk_size", ">= 1"),
    ({"chunk_size": 100.5}, "chunk_size", "whole number"),
    ({"chunk_size": "256"}, "chunk_size", "drop the quotes: 256"),
    ({"cpu_gb": 0}, "cpu_gb", "> 0"),
    ({"cpu_gb": None}, "cpu_gb", "leave the key out (default 4.0)"),
    ({"disk_gb": -1}, "disk_gb", ">= 0"),
    ({"num_programs": 1025}, "num_programs", "from 1 to 1024"),
    ({"staging_mb": 8}, "staging_mb", ">= 16"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s", "> 0"),
    ({"retention_interval": -256}, "retention_interval", ">= 0"),
    ({"retention_interval": 1000}, "retention_interval", "768 or 1024 (or 0)"),
    ({"chunk_size": 384}, "retention_interval", "got 4096 (int) (the default)"),
    ({"model_id": ""}, "model_id", "non-empty string"),
    ({"model_id": 3}, "model_id", "non-empty string"),
    ({"lmcache_log_level": "info"}, "lmcache_log_level", 'write "INFO"'),
    ({"lmcache_log_level": "LOUD"}, "lmcache_log_level", '"DEBUG", "INFO"'),
    ({"disk_gb": 3}, "disk_gb", "disk_path is not set"),
])
def test_bad_values(extra, key, says):
    assert says in error(extra, key)


def test_unknown_keys_suggest_close_matches():
    msg = error({"chunk": 256}, "chunk")
    assert 'rename "chunk" to "chunk_size"' in msg and "known keys: chunk_size, cpu_gb" in msg
    msg = error({"cpugb": 1, "zzz": 2}, "cpugb")
    assert '(nor is "zzz")' in msg and 'rename "cpugb" to "cpu_gb", remove "zzz"' in msg
    with pytest.raises(SettingsError, match="must be a JSON object"):
        parse([("cpu_gb", 4)])


# -- paths -------------------------------------------------------------------------------

def test_disk_path_rules(tmp_path):
    assert "absolute" in error({"disk_path": "cache/kv"}, "disk_path")
    assert "write it in full" in error({"disk_path": "~/kv"}, "disk_path")
    msg = error({"disk_path": str(tmp_path / "no" / "such")}, "disk_path")
    assert "parent" in msg and "does not exist" in msg
    (tmp_path / "file").write_text("x")
    assert "not a directory" in error({"disk_path": str(tmp_path / "file")}, "disk_path")
    assert parse({"disk_path": str(tmp_path / "new")}).disk_path == str(tmp_path / "new")
    assert not (tmp_path / "new").exists()  # parsing creates nothing
    same = {"type": "fs_native", "base_path": str(tmp_path) + "/"}
    msg = error({"disk_path": str(tmp_path), "l2_adapters": [same]}, "l2_adapters")
    assert msg.startswith('gemma4-kv: kv_connector_extra_config["l2_adapters"][0] is the same')


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_disk_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert "not writable" in error({"disk_path": str(ro)}, "disk_path")


def test_stats_file_rules(tmp_path):
    msg = error({"stats_file": str(tmp_path / "missing" / "s.jsonl")}, "stats_file")
    assert "does not exist" in msg and f"mkdir -p {tmp_path / 'missing'}" in msg
    assert "is a directory" in error({"stats_file": str(tmp_path)}, "stats_file")
    assert "file path" in error({"stats_file": 5}, "stats_file")


# -- l2_adapters through LMCache's parser ---------------------------------------------------

@pytest.mark.parametrize("value, says", [
    ("resp", "write a list of objects"),
    ('[{"type": "resp", "host": "h", "port": 1}]', "JSON text inside a string"),
    ({"type": "resp"}, 'wrap the object in a list: [{"type": "resp"}]'),
    (7, "must be a list of JSON objects"),
])
def test_l2_adapters_must_be_a_list(value, says):
    assert says in error({"l2_adapters": value}, "l2_adapters")


def adapter_error(spec, i: int = 0) -> str:
    msg = error({"l2_adapters": [MOCK] * i + [spec]}, "l2_adapters")
    assert msg.startswith(f'gemma4-kv: kv_connector_extra_config["l2_adapters"][{i}] '), msg
    return msg


def test_l2_adapter_list_of_strings():
    msg = adapter_error("resp", 1)
    assert 'got "resp" (str)' in msg and 'write {"type": "resp", ' in msg


def test_l2_adapter_unknown_type_lists_what_lmcache_knows():
    msg = adapter_error({"type": "redis", "host": "h", "port": 1})
    assert 'type LMCache does not know: "redis"' in msg and 'did you mean "valkey"?' in msg
    assert "gemma4_kv_resp" not in msg  # how `resp` is built here: not a type to write
    assert "fs_native" in msg and "valkey" in msg
    assert 'needs a "type" string' in adapter_error({"host": "h"})
    assert 'needs a "type" string' in adapter_error({"type": ["resp"]})


def test_resp_adapter_is_checked_by_lmcaches_parser_and_its_request_timeout():
    """`resp` is built over gemma4-kv's RespClient (tests/test_resp_client.py): LMCache's
    own fields are checked by LMCache's parser, `request_timeout` by ours."""
    ok = {"type": "resp", "host": "redis.local", "port": 6379, "num_workers": 4,
          "request_timeout": 2.5}
    assert parse({"l2_adapters": [ok]}).l2_adapters == (ok,)
    msg = adapter_error({"type": "resp", "port": 6379}, 1)
    assert 'is rejected by LMCache: host must be a non-empty string' in msg, msg
    msg = adapter_error({**ok, "request_timeout": 0})
    assert "request_timeout must be a number of seconds in (0, 3600]" in msg, msg
    assert "request_timeout (float)" in msg  # the fields' help names ours too


@pytest.mark.parametrize("serde", ["fp8", "turboquant"])
def test_serde_that_reads_one_tensor_is_refused(serde):
    """LMCache 0.5.6's fp8 serializer takes the object as one tensor (`MemoryObj.tensor`)
    and raises on an object of two (ours: KV and trailer), so no store reaches the
    tier: seen with fp8 against a real Valkey server (benchmarks/bench_valkey.py's
    adapter point never saw its keys arrive); turboquant's serializer does the same."""
    msg = adapter_error({"type": "valkey", "startup_nodes": "h:1",
                         "serde": {"type": serde, "max_workers": 2}}, 1)
    assert f'(type "valkey") field "serde" (type "{serde}") cannot be used' in msg, msg
    assert "checksum trailer" in msg and "nothing is ever stored" in msg
    assert 'fix: remove "serde"' in msg


def test_l2_adapter_bad_field_is_lmcache_parsers_error():
    msg = adapter_error({"type": "valkey", "startup_nodes": "redis.local:x",
                         "password": "hunter2"})
    assert ('(type "valkey") is rejected by LMCache: startup_nodes entry has non-integer '
            "port: 'redis.local:x'") in msg
    assert "hunter2" not in msg and '"password": "***"' in msg  # secrets are not echoed
    assert "startup_nodes (required): 'host:port'" in msg  # LMCache's help for the fields
    msg = adapter_error({"type": "mock", "max_size_gb": 1}, 1)
    assert '(type "mock")' in msg and "mock_bandwidth_gb" in msg


def test_l2_adapter_values_lmcache_would_coerce():
    msg = adapter_error({"type": "fs_native", "base_path": "/x", "shared": "false"})
    assert 'field "shared" must be true or false' in msg
    msg = adapter_error({"type": "valkey", "startup_nodes": "h:1", "max_capacity_gb": math.nan})
    assert 'NaN or infinity at ["max_capacity_gb"]' in msg
    for bad in ("0.8", 7, True):
        msg = adapter_error({"type": "fs_native", "base_path": "/x",
                             "eviction": {"eviction_policy": "LRU", "trigger_watermark": bad}})
        assert 'field "eviction"["trigger_watermark"] must be a number in (0, 1]' in msg
    good = {"type": "fs_native", "base_path": "/x", "max_capacity_gb": 1,
            "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.9, "eviction_ratio": 1}}
    assert parse({"l2_adapters": [good]}).l2_adapters == (good,)


def test_l2_adapters_without_lmcache(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmcache.v1.distributed.l2_adapters", None)
    assert "needs LMCache" in error({"l2_adapters": [MOCK]}, "l2_adapters")
    assert parse({"l2_adapters": []}).l2_adapters == ()


# -- host checks -------------------------------------------------------------------------

def test_cpu_gb_larger_than_the_machine():
    total = psutil.virtual_memory().total
    s = parse({"cpu_gb": 2 * total / GiB})
    with pytest.raises(SettingsError) as info:
        check_host_resources(s, ranks=2)
    msg = str(info.value)
    assert msg.startswith('gemma4-kv: kv_connector_extra_config["cpu_gb"] does not fit')
    assert "fix: set cpu_gb <= " in msg and "split over 2 tensor-parallel ranks" in msg
    check_host_resources(parse({"cpu_gb": 0.01}))


def test_memory_headroom_rule():
    assert memory_headroom(8 * GiB) == GiB  # at least 1 GiB
    assert memory_headroom(2048 * GiB) == int(102.4 * GiB)  # 5% of a large host


def test_cgroup_limit_caps_the_room(tmp_path):
    """A container's limit, as the kernel's cgroup v2 and v1 files state it (page cache
    that the kernel can reclaim counts as room)."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{8 * GiB}\n")
    (v2 / "memory.current").write_text(f"{3 * GiB}\n")
    (v2 / "memory.stat").write_text(f"anon 123\ninactive_file {GiB}\n")
    assert cgroup_room(str(v2)) == 6 * GiB
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_room(str(v2)) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    (v1 / "memory.stat").write_text("total_inactive_file 0\n")
    assert cgroup_room(str(tmp_path / "v1")) == 3 * GiB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_room(str(tmp_path / "v1")) is None
    assert cgroup_room(str(tmp_path / "none")) is None


def test_disk_path_is_created_private_and_disk_gb_checked(tmp_path):
    path = tmp_path / "tier" / "kv"
    (tmp_path / "tier").mkdir()
    check_host_resources(parse({"cpu_gb": 0.01, "disk_path": str(path), "disk_gb": 0.01}))
    assert path.is_dir() and (path.stat().st_mode & 0o777) == 0o700
    too_big = 2 * shutil.disk_usage(tmp_path).total / GiB
    with pytest.raises(SettingsError, match=r'^gemma4-kv: kv_connector_extra_config\["disk_gb"\]'
                       r" is larger than the file system"):
        check_host_resources(parse({"cpu_gb": 0.01, "disk_path": str(path),
                                    "disk_gb": too_big}))


@pytest.fixture
def listening():
    srv = socket.create_server(("127.0.0.1", 0))
    yield srv.getsockname()[1]
    srv.close()


@pytest.fixture
def closed_port():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_reachable_tiers_pass(listening, closed_port):
    check_tiers_reachable(parse({"l2_adapters": [
        MOCK, {"type": "valkey", "startup_nodes": f"127.0.0.1:{listening}"},
        # a cluster needs one reachable seed
        {"type": "valkey", "cluster_mode": True,
         "startup_nodes": f"127.0.0.1:{closed_port},127.0.0.1:{listening}"},
        {"type": "resp", "host": "127.0.0.1", "port": listening}]}))


def test_unreachable_resp_tier_names_the_adapter(closed_port):
    s = parse({"l2_adapters": [{"type": "resp", "host": "127.0.0.1", "port": closed_port}]})
    with pytest.raises(SettingsError, match=r'\[0\] \(type "resp"\) cannot be reached'):
        check_tiers_reachable(s, timeout_s=1.0)


def test_unreachable_tier_names_the_adapter(listening, closed_port):
    dead = {"type": "valkey", "startup_nodes": f"127.0.0.1:{closed_port}"}
    live = {"type": "valkey", "startup_nodes": f"127.0.0.1:{listening}"}
    s = parse({"l2_adapters": [live, dead]})  # parsing connects to nothing
    with pytest.raises(SettingsError) as info:
        check_tiers_reachable(s, timeout_s=1.0)
    msg = str(info.value)
    assert msg.startswith('gemma4-kv: kv_connector_extra_config["l2_adapters"][1] (type '
                          '"valkey") cannot be reached'), msg
    assert f"127.0.0.1:{closed_port}" in msg and "fix: start that server" in msg


def test_out_of_range_port_is_unreachable_not_a_crash():
    s = parse({"l2_adapters": [{"type": "valkey", "startup_nodes": "127.0.0.1:70000"}]})
    with pytest.raises(SettingsError, match=r"\[0\] \(type \"valkey\"\) cannot be reached"):
        check_tiers_reachable(s)


# -- README ------------------------------------------------------------------------------

def test_readme_table_lists_exactly_the_declared_keys():
    text = README.read_text()
    assert readme_table() in text, "README's table differs: paste readme_table()'s output"
    section = text.split("### `kv_connector_extra_config`", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert listed == [f.name for f in dataclasses.fields(ConnectorSettings)]
