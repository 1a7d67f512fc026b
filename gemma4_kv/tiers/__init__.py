"""Storage tiers outside the worker process (a running `lmcache server`, ...)."""
