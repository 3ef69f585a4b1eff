"""Bounds on what a model file may declare, checked before anything is allocated from it (torch-free).

A model file is input like any other: a count or a dimension in it decides how much memory and time a
load takes, so each is checked against the file's own size (the GGUF header parser, gguf_header.py), the
tensors it really holds (llama.check_shapes) and the maxima here, which sit well above every public
Llama-family model (Llama 3.1 405B: 126 layers, hidden 16384, FFN 53248, 128 heads of 128, vocabulary
128256; Gemma's vocabulary 256000; head_dim 256 at most) and far below what would exhaust a host.
"""

from __future__ import annotations

MAX_LAYERS = 1024
MAX_HIDDEN_SIZE = 1 << 16
MAX_INTERMEDIATE_SIZE = 1 << 20
MAX_HEADS = 1024  # query heads and key/value heads alike
MAX_HEAD_DIM = 512  # a rotary table row is head_dim wide: this bounds it with the row count below
MAX_VOCAB_SIZE = 1 << 22
# A context length is a promise, not an allocation (the rotary tables are sized by what is served), but
# no model reaches 16M positions and a larger number is a damaged or hostile file.
MAX_CONTEXT_LENGTH = 1 << 24
# Rotary table rows when the engine is not told max_model_len: the model's context, at most this
# (128K, Llama 3.1's own). 128K rows of head_dim 128 are 128 MiB in float32; a longer context is served
# by asking for it (--max-model-len), never by what a file claims.
DEFAULT_MAX_POSITIONS = 1 << 17

# GGUF: everything before the tensor data (key-values, tensor infos). The largest real vocabularies
# (256K tokens, 280K merges) take under 16 MiB; the parsed values take a small multiple of these bytes.
MAX_GGUF_HEADER_BYTES = 64 << 20
MAX_GGUF_TENSORS = 1 << 16
MAX_GGUF_KEYS = 1 << 16
MAX_GGUF_KEY_BYTES = 1 << 16  # the GGUF spec's own bound on a key
MAX_GGUF_TENSOR_NAME_BYTES = 256  # llama.cpp allows 63
MAX_GGUF_DIMS = 4  # GGML_MAX_DIMS
MAX_GGUF_ALIGNMENT = 1 << 16

# A Hugging Face config.json is a few KiB; nesting beyond a handful of levels is not a config.
MAX_CONFIG_JSON_BYTES = 1 << 20
MAX_CONFIG_JSON_DEPTH = 16
