"""The structured-output spec a request carries (`SamplingParams.structured_outputs`).

Exactly one constraint kind is set. The spec is plain data (no xgrammar import), so it travels to the
engine process inside SamplingParams and is rebuilt from a dict there. Whether a schema, regex or
grammar is *valid* is decided by the backend (`deepinfer.structured.backend.build_grammar`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


# Keywords whose values are instance data, not subschemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords mapping names to subschemas: a name there (even "enum" or "$ref") is not a keyword.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def check_json_schema(schema: Any) -> None:
    """ValueError naming the problem when `schema` is not a valid JSON schema (by its meta-schema) or
    refers outside itself: only refs into the schema (`#...`, e.g. `#/$defs/x`) can be constrained."""
    import jsonschema  # only requests with a schema pay for the import

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"invalid JSON schema: {e.message}") from None
    ref = _external_ref(schema)
    if ref is not None:
        raise ValueError(f"the JSON schema refers to {ref!r}: only refs inside the schema (starting with '#') "
                         "are supported")


def _external_ref(node: Any) -> str | None:
    """The first `$ref` (or `$dynamicRef`) in a (sub)schema that does not start with '#', or None."""
    if isinstance(node, list):
        return next((r for r in map(_external_ref, node) if r is not None), None)
    if not isinstance(node, dict):
        return None
    for key in ("$ref", "$dynamicRef"):
        if isinstance(node.get(key), str) and not node[key].startswith("#"):
            return node[key]
    children = [list(v.values()) if k in _SCHEMA_MAPS and isinstance(v, dict) else v
                for k, v in node.items() if k not in _DATA_KEYWORDS]
    return _external_ref(children)


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema, as a dict or its JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF dialect), root rule `root`
    structural_tag: str | None = None  # an xgrammar structural tag (JSON text); used for tool calls
    after_reasoning: bool = False  # thinking mode: the constraint starts after the model's `</think>`

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object or string, got {self.json!r}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("json_object", "after_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict | None:
        """The JSON schema as a dict (ValueError when its text is not JSON)."""
        if not isinstance(self.json, str):
            return self.json
        try:
            schema = json.loads(self.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        return schema

    def key(self) -> tuple[str, str]:
        """Identifies the compiled grammar (the reasoning gate is per request, not part of it)."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = self.schema
        return self.kind, json.dumps(value, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams | None:
        """Accepts an instance, a dict of its fields (as it arrives over the wire), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a dict of {', '.join(KINDS)}, got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown structured_outputs option(s) {unknown}; valid: {', '.join(KINDS)}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, False)}
