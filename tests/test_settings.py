"""kv_connector_extra_config parsing: known keys, defaults, clear errors."""

import pytest

from gemma4_kv.settings import ConnectorSettings


def test_defaults_and_overrides():
    s = ConnectorSettings.from_extra_config(None)
    assert s.chunk_size == 256 and s.cpu_gb == 4.0
    s = ConnectorSettings.from_extra_config({"chunk_size": 512, "cpu_gb": 8, "disk_path": "/d",
                                             "disk_gb": 10})
    cfg = s.store_config()
    assert cfg.cpu_bytes == 8 << 30
    assert cfg.adapter_specs()[0]["type"] == "fs_native"


def test_unknown_key_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        ConnectorSettings.from_extra_config({"chunk": 256})


def test_nonsense_values_rejected():
    with pytest.raises(ValueError, match="positive"):
        ConnectorSettings.from_extra_config({"cpu_gb": 0})
