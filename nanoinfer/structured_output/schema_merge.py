"""Two JSON schemas as one (allOf), so that keywords beside `$ref`, `anyOf` and `allOf` hold.

`merge(a, b)` is a schema that a value satisfies where it satisfies both: each keyword of one
side, or the two combined where both have it (types intersected, the larger minimum and the
smaller maximum, required lists joined, enums intersected, properties and items merged in turn).
A property that only one side lists meets the other side's `additionalProperties` (`false`
there: the property cannot be written). A combination the compiler cannot express (two
different patterns, say) is a ValueError naming the keyword, and one nothing satisfies (types
without a common one) is `Unsatisfiable`, which an anyOf takes as a branch to leave out.
"""
import json

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$comment",
               "$defs", "definitions", "format", "deprecated", "readOnly", "writeOnly",
               "$anchor", "contentMediaType", "contentEncoding", "contentSchema"}


class Unsatisfiable(ValueError):
    """No JSON value is valid under the schema (an anyOf drops such a branch)."""


def dumps(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise ValueError(f"JSON schema value {value!r} is not JSON (a number out of range?)"
                         ) from None


def without(schema: dict, *keys: str) -> dict:
    return {k: v for k, v in schema.items() if k not in keys}


def count(schema: dict, key: str) -> int:
    value = schema.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"JSON schema keyword {key!r} must be an integer >= 0, got {value!r}")
    return value


def merge(a, b):
    """A schema valid where both are (allOf): the keywords of each side, combined where both
    have one; a combination not supported is a ValueError naming the keyword."""
    if a is True or a == {} or b is False:
        return b
    if b is True or b == {} or a is False:
        return a
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise ValueError(f"a JSON schema must be an object, got {a!r} and {b!r}")
    a, b = as_enum(a), as_enum(b)
    out = dict(a)
    for key, value in b.items():
        if key not in out or key in ANNOTATIONS:
            out.setdefault(key, value)
        elif key == "enum":   # (compared as JSON texts: in Python, 1 == True)
            out[key] = [v for v in out[key] if dumps(v) in set(map(dumps, value))]
        elif key == "properties" or out[key] == value:
            pass
        elif key == "type":
            out[key] = sorted(types_of(out[key]) & types_of(value))
            if "number" in out[key]:
                out[key].remove("integer")
        elif key in ("minItems", "minLength", "maxItems", "maxLength"):
            out[key] = (max if key.startswith("min") else min)(count(out, key), count(b, key))
        elif key == "required" or key == "allOf":
            out[key] = list(out[key]) + [v for v in value if v not in out[key]]
        elif key in ("items", "additionalProperties"):
            out[key] = merge(out[key], value)
        else:
            raise ValueError(f"unsupported JSON schema: two different {key!r} to hold together")
    if "properties" in a or "properties" in b:   # where one side has none: additionalProperties
        sides = [(s.get("properties", {}), s.get("additionalProperties", True)) for s in (a, b)]
        names = dict.fromkeys([*sides[0][0], *sides[1][0]])
        out["properties"] = {n: merge(*(props.get(n, extra) for props, extra in sides))
                             for n in names}
    return out


def types_of(types) -> set[str]:
    """A `type` as a set, "number" taken to include "integer"."""
    out = set(types) if isinstance(types, list) else {types}
    return out | {"integer"} if "number" in out else out


def as_enum(schema: dict) -> dict:
    """`const` written as a one-value `enum` (within any enum beside it)."""
    if "const" not in schema:
        return schema
    values = [schema["const"]]
    if "enum" in schema:
        values = [v for v in values if dumps(v) in set(map(dumps, schema["enum"]))]
    return {**without(schema, "const"), "enum": values}
