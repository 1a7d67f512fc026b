"""Configuration: the `kv_connector_extra_config` schema, its checks and the host checks
at start-up."""
