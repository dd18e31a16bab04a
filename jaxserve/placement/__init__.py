"""Where arrays live: the device mesh, sharding, the KV pool and its memory, compile targets, and
the facts resolved once at start."""
