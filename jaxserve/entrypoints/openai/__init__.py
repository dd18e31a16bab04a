"""The OpenAI-compatible HTTP server (`jaxserve serve`)."""

API_KEY_ENV = "JAXSERVE_API_KEY"  # the key when --api-key is not given: not visible in ps
