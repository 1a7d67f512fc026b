"""Which LMCache this package speaks (`check_version`) and how loud LMCache's own logs
are (`set_log_level`).

Supported: LMCache 0.5.6 exactly (its storage layer's API and the engine-driven wire
format of its server change between releases).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

SUPPORTED_VERSION = "0.5.6"
class UnsupportedLMCache(RuntimeError):
    """The installed LMCache is not the version this package speaks."""


def check_version() -> str:
    """The installed LMCache version; raises if it is not the supported one."""
    try:
        version = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedLMCache("gemma4-kv needs LMCache, which is not installed; fix: "
                                 "pip install 'gemma4-kv[lmcache]'") from None
    if version != SUPPORTED_VERSION:
        raise UnsupportedLMCache(
            f"gemma4-kv speaks LMCache {SUPPORTED_VERSION}'s storage API, found {version}; "
            f"fix: pip install lmcache=={SUPPORTED_VERSION}")
    return version


def set_log_level(level: str) -> None:
    """Keep LMCache's own logs (one INFO line per prefetch) at `level`. LMCache reads
    LMCACHE_LOG_LEVEL when it creates a logger and gives each its own handler, so set
    both the variable (for loggers still to come) and every existing one."""
    os.environ["LMCACHE_LOG_LEVEL"] = level
    for name, log in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("lmcache") and isinstance(log, logging.Logger):
            log.setLevel(level)
            for handler in log.handlers:
                handler.setLevel(level)
