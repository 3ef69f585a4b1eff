"""Twenty varied prompts for the parity tests: chat and plain, from a few tokens to about 400."""

from __future__ import annotations

_STORY = (
    "The lighthouse keeper had kept the lamp burning for forty years. Every evening he climbed the one "
    "hundred and twelve steps, trimmed the wick, polished the great lens and watched the beam sweep across "
    "the grey water. Ships passed in the night, their captains grateful for the steady light, though none "
    "of them ever knew his name. One winter a storm came that was worse than any he had seen. The wind "
    "tore slates from the roof of his cottage and the waves climbed the rocks until spray hit the gallery "
    "windows. Through the rain he saw a small fishing boat struggling toward the harbour, its mast broken. "
)

CHAT = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "Translate 'good morning' into Spanish and German.",
    "What is a paged KV cache, briefly?",
    "Summarise this story in one sentence:\n\n" + _STORY,
    "Give me a short Python function that reverses a string.",
    "Réponds en français : quelle est la couleur du ciel ?",
]

PLAIN = [
    "Once upon a time there",
    "The quick brown fox jumps",
    "import torch\nimport torch.nn as nn\n\nclass",
    "Water boils at a temperature of",
    "In the beginning of the twentieth century, the city",
    _STORY,
    _STORY * 3 + "The keeper lit a flare and",
    "日本の首都は",
    "Dear hiring manager,\n\nI am writing to apply for",
    "Roses are red, violets are blue,",
]


def parity_prompt_ids(tokenizer) -> list[list[int]]:
    """Token ids of the twenty prompts: chat ones through the model's chat template."""
    chat = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHAT]
    plain = [tokenizer.encode(text) for text in PLAIN]
    return chat + plain
