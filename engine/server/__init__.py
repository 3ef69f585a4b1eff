"""`loraplex serve`: the engine behind an OpenAI-compatible HTTP API.

One background thread owns the LLMEngine (`async_engine`); HTTP handlers (`app`) post requests to it
and stream tokens back (`delivery`). `protocol` holds the OpenAI request and response shapes, `metrics`
the Prometheus series, `settings` the options (flags and LORAPLEX_* environment variables), `serve`
the uvicorn process and its drain on SIGTERM.
"""
