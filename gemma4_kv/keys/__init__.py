"""Keys: the engine fingerprint and the chunk keys of a request (everything the KV depends on)."""
