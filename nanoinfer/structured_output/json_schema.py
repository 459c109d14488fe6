"""JSON schema -> regular expression (then regex.py makes the DFA).

A schema without recursion describes a regular language of JSON texts, so it can be written as
one regex. The promise: every text the regex matches is valid under the schema (as `jsonschema`
judges it); what cannot be honoured is a ValueError naming it, never a keyword dropped. To keep
the language regular and small, the regex allows one way of writing each value, not all of them:
- the JSON is compact (`{"a":1,"b":[2,3]}`) except that one optional space may follow each `:`
  and `,`, which most models like to write;
- object properties come in the schema's order, each at most once; a property that is not
  `required` may be left out, and no other property is written (whatever
  `additionalProperties` says); an object schema without `properties` or `required` is any
  object whose values follow `additionalProperties` (any JSON value, if it is absent);
- a string is a full match of its `pattern`, which then also matches as JSON Schema's search;
  its characters are those JSON need not escape (an unsatisfiable pattern is a ValueError);
- an `enum` or `const` number is written as its JSON text, an integral one also with `.0`s.

Supported: `type` (one or a list), `properties`, `required`, `additionalProperties`, `items`,
`minItems`, `maxItems`, `enum`, `const`, `pattern` (ECMAScript's dialect), `minLength` and
`maxLength` (in code points: an escaped surrogate pair is one; not together with `pattern`),
`anyOf`, `allOf`, `$ref` to a local JSON pointer (`#/$defs/...`, not recursive), `true`,
`false`, and the annotations (`title`, `description`, `format`, ...), which are ignored.
Keywords beside `$ref`, `anyOf` and `allOf` hold too: the schemas are merged (`merge`), and an
`enum` or `const` keeps the values its sibling keywords allow. A schema without `type` takes the
types its keywords are about (`minLength`: a string; `properties`: an object), or any JSON value
nested at most `ANY_DEPTH` deep if it has none. Anything else is a ValueError naming the keyword.
"""
import json
import math
import re

from nanoinfer.structured_output.dfa import compile_regex
from nanoinfer.structured_output.regex import parse, to_regex

WS = "[ ]?"
SEP = "," + WS
HEX = "[0-9a-fA-F]"
# one character of a JSON string: as itself, a short escape, \u of a code point that is not a
# surrogate, or a surrogate pair (one code point, as JSON Schema's lengths count it)
STRING_CHAR = (rf'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F]{HEX}{{3}}'
               rf'|[dD][0-7]{HEX}{{2}})|\\u[dD][89abAB]{HEX}{{2}}\\u[dD][c-fC-F]{HEX}{{2}})')
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(\.[0-9]+)?([eE][-+]?[0-9]+)?"
SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": "(true|false)",
           "null": "null"}
TYPE_KEYWORDS = {"object": {"properties", "required", "additionalProperties"},
                 "array": {"items", "minItems", "maxItems"},
                 "string": {"pattern", "minLength", "maxLength"}}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
               "$defs", "definitions", "format", "deprecated", "readOnly", "writeOnly",
               "$anchor", "contentMediaType", "contentEncoding", "contentSchema"}
KEYWORDS = {"type", "enum", "const", "anyOf", "allOf", "$ref"}.union(*TYPE_KEYWORDS.values())
MAX_REGEX_CHARS = 200_000
ANY_DEPTH = 2
NOT_RAW_IN_STRINGS = [(0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))]   # JSON escapes


class Unsatisfiable(ValueError):
    """No JSON value is valid under the schema (an anyOf drops such a branch)."""


def dumps(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise ValueError(f"JSON schema value {value!r} is not JSON (a number out of range?)") from None


def literal(value) -> str:
    """A JSON value as a regex that matches its compact text (a number also in equal forms)."""
    text = re.escape(dumps(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return text
    if value == int(value) and abs(value) < 2**53:
        return re.escape(str(int(value))) + r"(\.0+)?"
    return text + ("0*" if "." in text and "e" not in text else "")


def repeat(item: str, lo: int, hi: int | None) -> str:
    """lo to hi (None: any number) of `item`, separated by commas."""
    if hi == 0:
        return ""
    count = f"{{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
    more = f"({SEP}{item})" + ("*" if hi is None and lo <= 1 else count)
    return f"({item}{more})" + ("?" if lo == 0 else "")


def any_value(depth: int) -> str:
    scalar = "|".join(SCALARS.values())
    if depth == 0:
        return f"({scalar})"
    inner = any_value(depth - 1)
    members = repeat(f"{STRING}:{WS}{inner}", 0, None)
    return rf"({scalar}|\{{{members}\}}|\[{repeat(inner, 0, None)}\])"


def without(schema: dict, *keys: str) -> dict:
    return {k: v for k, v in schema.items() if k not in keys}


def count(schema: dict, key: str) -> int:
    value = schema.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"JSON schema keyword {key!r} must be an integer >= 0, got {value!r}")
    return value


class SchemaCompiler:
    def __init__(self, root):
        self.root, self.resolving = root, []

    def compile(self, schema) -> str:
        regex = self.compile_one(schema)
        if len(regex) > MAX_REGEX_CHARS:   # (nested repeats double it at every level: stop early)
            raise ValueError("the JSON schema is too large: its regex has more than "
                             f"{MAX_REGEX_CHARS:,} characters")
        return regex

    def compile_one(self, schema) -> str:
        if schema is True:
            return any_value(ANY_DEPTH)
        if schema is False:
            raise Unsatisfiable("the JSON schema `false` matches nothing")
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {schema!r}")
        unknown = set(schema) - KEYWORDS - ANNOTATIONS
        if unknown:
            raise ValueError(f"unsupported JSON schema keyword {sorted(unknown)[0]!r}")
        for key in ("enum", "anyOf", "allOf", "type"):
            if schema.get(key) == []:
                raise Unsatisfiable(f"JSON schema keyword {key!r} with an empty list matches nothing")
        if "$ref" in schema:
            return self.ref(schema)
        if "allOf" in schema:
            merged = without(schema, "allOf")
            for sub in schema["allOf"]:
                merged = self.merge(merged, sub)
            return self.compile(merged)
        if "anyOf" in schema:
            return self.any_of(schema)
        if "const" in schema or "enum" in schema:
            return self.values(schema)
        types = schema.get("type")
        if types is None:   # the types its keywords are about; without any, every type
            types = [t for t, keys in TYPE_KEYWORDS.items() if keys & schema.keys()] or True
        if types is True:
            return any_value(ANY_DEPTH)
        return self.alternatives([lambda t=t: self.typed(schema, t)
                                  for t in (types if isinstance(types, list) else [types])])

    @staticmethod
    def alternatives(options) -> str:
        """The regexes of the options that something satisfies, as one alternation."""
        regexes, error = [], None
        for option in options:
            try:
                regexes.append(option())
            except Unsatisfiable as e:
                error = e
        if not regexes:
            raise error
        return "(" + "|".join(regexes) + ")"

    def any_of(self, schema: dict) -> str:
        """Each branch with the keywords beside anyOf; branches nothing satisfies are left out."""
        rest = without(schema, "anyOf")
        return self.alternatives([lambda b=b: self.compile(self.merge(rest, b))
                                  for b in schema["anyOf"]])

    def values(self, schema: dict) -> str:
        """enum / const: the values that the sibling keywords allow too."""
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list):
            raise ValueError(f"JSON schema keyword 'enum' must be a list, got {values!r}")
        rest = without(schema, "const") if "const" in schema else without(schema, "enum")
        if set(rest) - ANNOTATIONS:   # (our own DFA of the rest judges them)
            dfa = compile_regex(self.compile(rest))
            values = [v for v in values if dfa.accepting[dfa.walk(dfa.start, dumps(v).encode())]]
        if not values:
            raise Unsatisfiable("no value of the JSON schema's enum/const is valid under its other "
                                "keywords")
        return "(" + "|".join(map(literal, values)) + ")"

    def typed(self, schema: dict, type_: str) -> str:
        if type_ == "object":
            return self.object(schema)
        if type_ == "array":
            return self.array(schema)
        if type_ == "string" and "pattern" in schema:   # taken as a full match (it then matches)
            if "minLength" in schema or "maxLength" in schema:
                raise ValueError("unsupported JSON schema: 'pattern' together with "
                                 "'minLength'/'maxLength'")
            pattern = parse(schema["pattern"], ecmascript=True)
            return '"' + to_regex(pattern, NOT_RAW_IN_STRINGS) + '"'
        if type_ == "string" and ("minLength" in schema or "maxLength" in schema):
            lo, hi = count(schema, "minLength"), schema.get("maxLength")
            if hi is not None and count(schema, "maxLength") < lo:
                raise Unsatisfiable("JSON schema with maxLength < minLength matches nothing")
            return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'
        if type_ not in SCALARS:
            raise ValueError(f"unsupported JSON schema type {type_!r}")
        return SCALARS[type_]

    def array(self, schema: dict) -> str:
        lo, hi = count(schema, "minItems"), schema.get("maxItems")
        if hi is not None and count(schema, "maxItems") < lo:
            raise Unsatisfiable("JSON schema with maxItems < minItems matches nothing")
        items = schema.get("items", True)
        if not isinstance(items, (dict, bool)):
            raise ValueError(f"unsupported JSON schema 'items' {items!r}: it must be a schema")
        if items is False:
            hi = 0
        return rf"\[{repeat(self.compile(items) if hi != 0 else '', lo, hi)}\]"

    def object(self, schema: dict) -> str:
        extra = schema.get("additionalProperties", True)
        props = dict(schema.get("properties", {}))
        required = schema.get("required", [])
        for name in required:   # (required without a schema of its own: additionalProperties')
            props.setdefault(name, extra)
        if not props:   # any object (whose values follow additionalProperties)
            if extra is False:
                return r"\{\}"
            return rf"\{{{repeat(f'{STRING}:{WS}{self.compile(extra)}', 0, None)}\}}"
        parts = []
        for name, sub in props.items():
            try:
                parts.append((literal(name) + ":" + WS + self.compile(sub), name in required))
            except Unsatisfiable:
                if name in required:
                    raise
        if not parts:
            return r"\{\}"

        def after(i: int) -> str:   # properties i.. when one was written before them
            return "".join(f"{SEP}{p}" if req else f"({SEP}{p})?" for p, req in parts[i:])

        def first(i: int) -> str:   # properties i.. when none was written yet
            if i == len(parts):
                return ""
            p, req = parts[i]
            return p + after(i + 1) if req else f"({p}{after(i + 1)}|{first(i + 1)})"
        return rf"\{{{first(0)}\}}"

    def ref(self, schema: dict) -> str:
        """A local JSON pointer (#/...), with the keywords beside it."""
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"unsupported $ref {ref!r}: only references inside the schema (#/...)")
        target = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise ValueError(f"$ref {ref!r} names nothing in the schema")
        if ref in self.resolving:
            raise ValueError(f"recursive $ref {ref!r}: a recursive schema is not a regular language")
        self.resolving.append(ref)
        try:
            return self.compile(self.merge(without(schema, "$ref"), target))
        finally:
            self.resolving.pop()

    def merge(self, a, b):
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
                out[key] = self.merge(out[key], value)
            else:
                raise ValueError(f"unsupported JSON schema: two different {key!r} to hold together")
        if "properties" in a or "properties" in b:   # where one side has none: additionalProperties
            sides = [(s.get("properties", {}), s.get("additionalProperties", True)) for s in (a, b)]
            names = dict.fromkeys([*sides[0][0], *sides[1][0]])
            out["properties"] = {n: self.merge(*(props.get(n, extra) for props, extra in sides))
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


def json_schema_to_regex(schema: dict | str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    return SchemaCompiler(schema).compile(schema)
