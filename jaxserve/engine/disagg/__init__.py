"""Disaggregated prefill/decode: a prefill engine and a decode engine on separate devices (or
processes), with each request's KV blocks moved from one to the other after its first token.
See docs/disaggregation.md.

Modules: `settings` (the `disaggregation` argument, no jax), `prefill` (the prefill side),
`connector` (the KVConnector interface and the in-process connector), `socket_connector`,
`prefill_server` and `wire` (two processes over loopback), `core` (DisaggregatedEngineCore).
"""
