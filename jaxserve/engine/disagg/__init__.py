"""Disaggregated prefill/decode: a prefill engine and a decode engine on separate devices (or
processes), each an ordinary EngineCore, with each request's prompt KV moved from one to the
other after its first token by a KV connector (`engine/kv_connector.py`). See
docs/disaggregation.md.

Modules: `decode_core` (the engine the user holds), `prefill_engine` (the prefill side),
`connector` (in-process: device-to-device copies), `socket_connector`, `prefill_server` and
`wire` (two processes over loopback).
"""
