"""Admission as the API server does it, for the InferenceDeployment CRD: defaults, then the openAPIV3Schema
(jsonschema), then every `x-kubernetes-validations` CEL rule (cel-python), each rule evaluated with `self`
bound to the value at its node, numbers typed as the schema says (Kubernetes hands `type: number` to CEL
as a double, `integer` as an int).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import celpy
import jsonschema

from tests.operator.helpers import crd_schema


@dataclass(frozen=True)
class Rule:
    path: str  # JSON-path-like location of the schema node, e.g. spec.replicas
    rule: str
    message: str


@dataclass(frozen=True)
class Failure:
    rule: Rule
    value_path: str  # where in the body, e.g. spec.podTemplate.spec.volumes[0]


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: a missing property with a `default` gets it, then defaults apply inside."""
    if isinstance(value, dict) and schema.get("type") == "object":
        result = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in result and "default" in sub:
                result[key] = copy.deepcopy(sub["default"])
            if key in result:
                result[key] = with_defaults(sub, result[key])
        return result
    if isinstance(value, list) and schema.get("type") == "array":
        return [with_defaults(schema.get("items") or {}, item) for item in value]
    return value


def _typed(schema: dict[str, Any], value: Any) -> Any:
    """The value as CEL sees it: `number` fields are doubles even when written as 4."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        extra = extra if isinstance(extra, dict) else {}
        return {k: _typed(properties.get(k, extra), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(schema.get("items") or {}, item) for item in value]
    return value


@cache
def _program(rule: str) -> Any:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def rules(schema: dict[str, Any] | None = None, path: str = "") -> Iterator[Rule]:
    """Every CEL rule in the schema, with where it sits."""
    schema = crd_schema() if schema is None else schema
    for item in schema.get("x-kubernetes-validations") or []:
        yield Rule(path or "<root>", item["rule"], item["message"])
    for key, sub in (schema.get("properties") or {}).items():
        yield from rules(sub, f"{path}.{key}" if path else key)
    if isinstance(schema.get("additionalProperties"), dict):
        yield from rules(schema["additionalProperties"], f"{path}.*")
    if isinstance(schema.get("items"), dict):
        yield from rules(schema["items"], f"{path}[]")


def cel_failures(body: dict[str, Any]) -> list[Failure]:
    schema = crd_schema()
    return list(_walk(schema, with_defaults(schema, body), "", ""))


def _walk(schema: dict[str, Any], value: Any, path: str, where: str) -> Iterator[Failure]:
    for item in schema.get("x-kubernetes-validations") or []:
        rule = Rule(path or "<root>", item["rule"], item["message"])
        result = _program(rule.rule).evaluate({"self": celpy.json_to_cel(_typed(schema, value))})
        if isinstance(result, celpy.CELEvalError):
            raise AssertionError(f"rule {rule.rule!r} at {where or '<root>'} did not evaluate: {result}")
        if not bool(result):
            yield Failure(rule, where or "<root>")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                yield from _walk(
                    sub, value[key], f"{path}.{key}" if path else key, f"{where}.{key}".lstrip(".")
                )
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, sub_value in value.items():
                yield from _walk(extra, sub_value, f"{path}.*", f"{where}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _walk(schema["items"], item, f"{path}[]", f"{where}[{i}]")


def schema_errors(body: dict[str, Any]) -> list[str]:
    schema = crd_schema()
    validator = jsonschema.Draft4Validator(schema)
    return [error.message for error in validator.iter_errors(with_defaults(schema, body))]


def errors_against(schema: dict[str, Any], body: dict[str, Any]) -> list[str]:
    """Admission of `body` by any CRD's openAPIV3Schema (defaults, schema, CEL), e.g. a vendored one."""
    value = with_defaults(schema, body)
    errors = [error.message for error in jsonschema.Draft4Validator(schema).iter_errors(value)]
    return errors + [failure.rule.message for failure in _walk(schema, value, "", "")]


def admission_errors(body: dict[str, Any]) -> list[str]:
    """What the API server would answer to a create: schema messages, then CEL rule messages."""
    errors = schema_errors(body)
    return errors + [failure.rule.message for failure in cel_failures(body)]
