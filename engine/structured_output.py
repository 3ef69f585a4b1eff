"""What a request's output must follow (structured outputs): a JSON schema, as plain data, no torch.

It rides in SamplingParams (`structured`); the engine compiles it into a grammar (engine/grammar.py)
whose token mask the sampler applies to the request's row. `schema` is the schema's canonical JSON text
(sorted keys, no spaces), so two requests with the same schema share one compiled grammar (`digest`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from loraplex.wire import limits

# response_format {"type": "json_object"}: any JSON object (OpenAI's promise), as a schema.
JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class StructuredOutput:
    schema: str  # canonical JSON of the schema
    # strict: the schema's own words only (no properties it does not name, unless it says so); otherwise
    # what JSON Schema allows (additional properties where the schema is silent).
    strict: bool = False
    # The request field the schema came from: a schema that cannot compile is a 400 naming it.
    param: str = field(default="response_format.json_schema.schema", compare=False)

    @classmethod
    def of(
        cls, schema: Any, strict: bool = False, param: str = "response_format.json_schema.schema"
    ) -> StructuredOutput:
        """From a schema as parsed JSON (bounded by wire/limits.py's check_schema)."""
        limits.check_schema(param, schema)
        return cls(json.dumps(schema, sort_keys=True, separators=(",", ":")), bool(strict), param)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls.of(JSON_OBJECT, param="response_format")

    @property
    def digest(self) -> str:
        """What a compiled grammar is cached by: the schema and how strictly it is read."""
        return hashlib.sha256(f"{int(self.strict)}:{self.schema}".encode()).hexdigest()


def from_response_format(value: dict[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's response_format (checked by wire/limits.py's check_response_format) as what the engine
    follows: None for text, any JSON object for json_object, the schema for json_schema."""
    kind = (value or {}).get("type", "text")
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind != "json_schema":
        return None
    spec = value["json_schema"] if value else {}
    return StructuredOutput.of(spec.get("schema", {}), strict=bool(spec.get("strict")))


__all__ = ["JSON_OBJECT", "StructuredOutput", "from_response_format"]
