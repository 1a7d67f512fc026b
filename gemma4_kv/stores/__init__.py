"""Stores: one interface (`base.ChunkStore`), LMCache embedded in-process or a running
`lmcache server` behind it."""
