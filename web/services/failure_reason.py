"""What a tenant may read of an engine's reason for failing its adapter at run time.

The engine words its reasons for its operators: they name the adapter by its engine name
(`wire.adapter_name`, quoted), and a step failure lists the requests it saw (`req-…`, `cmpl-…`).
A reason kept on an adapter row is shown to every member of its tenant (API, console, the gateway's
later refusals), so it keeps what says what is wrong with the weights and drops every identifier:
an id read there is never another request's, another key's or another tenant's.
"""

from __future__ import annotations

import re

from loraplex import wire

# An engine name of the gateway's adapters, quoted as the engine quotes names (repr), or bare.
_ENGINE_NAME = re.compile(
    r"""(?:adapter\s+)?(?:'{0}[^']*'|"{0}[^"]*"|{0}\S+)""".format(re.escape(wire.ADAPTER_NAME_PREFIX)),
    re.IGNORECASE,
)
# Request and response ids: the engine's own (`req-<hex>`, `req-<n>`) and OpenAI's (`cmpl-`, `chatcmpl-`),
# one or a comma-separated list of them (a step's non-finite rows are listed so).
_REQUEST_IDS = re.compile(r"\b(?:req|cmpl|chatcmpl)-[\w-]+(?:\s*,\s*(?:req|cmpl|chatcmpl)-[\w-]+)*")
# Any other id: a UUID (adapter, tenant, key), or a long hex run that is not a 64-digit content digest
# (a digest names the bytes, which the reader uploaded, not whoever else holds them).
_UUID = re.compile(r"\b[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}\b", re.IGNORECASE)
_HEX_RUN = re.compile(r"\b(?![0-9a-f]{64}\b)[0-9a-f]{16,}\b", re.IGNORECASE)


def public_reason(message: str) -> str:
    """`message` without adapter names, request ids or other ids: safe to keep and show to a tenant."""
    text = _ENGINE_NAME.sub("the adapter", message)
    text = _REQUEST_IDS.sub("a request", text)
    text = _UUID.sub("…", text)
    return _HEX_RUN.sub("…", text)
