"""JSON schema -> regular expression (then regex.py makes the DFA).

A schema without recursion describes a regular language of JSON texts, so it can be written as
one regex. Whitespace is fixed: the JSON is compact (`{"a":1,"b":[2,3]}`) except that one
optional space may follow each `:` and `,`, which most models like to write. Object properties
come in the schema's order; a property that is not `required` may be left out.

Supported keywords: `type` (one or a list), `properties`, `required`, `additionalProperties:
false` (the only behaviour: no other properties), `items`, `minItems`, `maxItems`, `enum`,
`const`, `pattern`, `minLength`, `maxLength`, `anyOf`, `$ref` to `#/$defs/...` (or
`#/definitions/...`), and the annotations (`title`, `description`, ...), which are ignored. A
schema of no type (`{}`) is any JSON value nested at most `ANY_DEPTH` deep, and an object
without `properties` any object (response_format `json_object`). A string `pattern`
is taken as a full match (which then also matches as JSON Schema's search), its text without
the characters JSON must escape. Anything else is a ValueError naming the keyword.
"""
import json
import math
import re

from nanoinfer.structured_output.regex import parse, to_regex

WS = "[ ]?"
SEP = "," + WS
STRING_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(\.[0-9]+)?([eE][-+]?[0-9]+)?"
SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": "(true|false)", "null": "null"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs",
               "definitions", "format", "deprecated", "readOnly", "writeOnly"}
MAX_REGEX_CHARS = 200_000
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
            "enum", "const", "pattern", "minLength", "maxLength", "anyOf", "$ref"}
ANY_DEPTH = 2
NOT_RAW_IN_STRINGS = [(0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))]   # JSON escapes these


def literal(value) -> str:
    """A JSON value as a regex that matches exactly its compact text."""
    return re.escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


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


class SchemaCompiler:
    def __init__(self, root: dict):
        self.root, self.resolving = root, []

    def compile(self, schema) -> str:
        regex = self.compile_one(schema)
        if len(regex) > MAX_REGEX_CHARS:   # (nested repeats double it at every level: stop early)
            raise ValueError(f"the JSON schema is too large: its regex has more than {MAX_REGEX_CHARS:,} characters")
        return regex

    def compile_one(self, schema) -> str:
        if schema is True or schema == {}:
            return any_value(ANY_DEPTH)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {schema!r}")
        unknown = set(schema) - KEYWORDS - ANNOTATIONS
        if unknown:
            raise ValueError(f"unsupported JSON schema keyword {sorted(unknown)[0]!r}")
        if schema.get("additionalProperties", False) is not False:
            raise ValueError("unsupported JSON schema keyword 'additionalProperties' other than false")
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        for key in ("enum", "anyOf", "type"):
            if schema.get(key) == []:
                raise ValueError(f"JSON schema keyword {key!r} with an empty list: nothing would match")
        if "const" in schema:
            return literal(schema["const"])
        if "enum" in schema:
            return "(" + "|".join(literal(v) for v in schema["enum"]) + ")"
        if "anyOf" in schema:
            return "(" + "|".join(self.compile(s) for s in schema["anyOf"]) + ")"
        types = schema.get("type")
        if types is None:
            return any_value(ANY_DEPTH)
        if isinstance(types, list):
            return "(" + "|".join(self.typed(schema, t) for t in types) + ")"
        return self.typed(schema, types)

    def typed(self, schema: dict, type_: str) -> str:
        for key in ("minItems", "maxItems", "minLength", "maxLength"):
            value = schema.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"JSON schema keyword {key!r} must be an integer >= 0, got {value!r}")
        if type_ == "object":
            return self.object(schema)
        if type_ == "array":
            items = self.compile(schema.get("items", {}))
            if schema.get("maxItems", math.inf) < schema.get("minItems", 0):
                raise ValueError("JSON schema with maxItems < minItems: nothing would match")
            return rf"\[{repeat(items, schema.get('minItems', 0), schema.get('maxItems'))}\]"
        if type_ == "string" and "pattern" in schema:   # taken as a full match (it then matches)
            if "minLength" in schema or "maxLength" in schema:
                raise ValueError("unsupported JSON schema: 'pattern' together with 'minLength'/'maxLength'")
            return '"' + to_regex(parse(schema["pattern"]), NOT_RAW_IN_STRINGS) + '"'
        if type_ == "string" and ("minLength" in schema or "maxLength" in schema):
            hi = schema.get("maxLength", "")
            return f'"{STRING_CHAR}{{{schema.get("minLength", 0)},{hi}}}"'
        if type_ not in SCALARS:
            raise ValueError(f"unsupported JSON schema type {type_!r}")
        return SCALARS[type_]

    def object(self, schema: dict) -> str:
        if not {"properties", "required", "additionalProperties"} & schema.keys():   # any object
            return rf"\{{{repeat(f'{STRING}:{WS}{any_value(ANY_DEPTH)}', 0, None)}\}}"
        props = list(schema.get("properties", {}).items())
        required = set(schema.get("required", []))
        missing = required - {name for name, _ in props}
        if missing:
            raise ValueError(f"required property {sorted(missing)[0]!r} is not in 'properties'")
        parts = [(literal(name) + ":" + WS + self.compile(sub), name in required) for name, sub in props]

        def after(i: int) -> str:   # properties i.. when one was written before them
            return "".join(f"{SEP}{p}" if req else f"({SEP}{p})?" for p, req in parts[i:])

        def first(i: int) -> str:   # properties i.. when none was written yet
            if i == len(parts):
                return ""
            p, req = parts[i]
            return p + after(i + 1) if req else f"({p}{after(i + 1)}|{first(i + 1)})"
        return rf"\{{{first(0)}\}}"

    def ref(self, ref: str) -> str:
        prefix = next((p for p in ("#/$defs/", "#/definitions/") if ref.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"unsupported $ref {ref!r}: only #/$defs/... and #/definitions/...")
        defs = self.root.get(prefix[2:-1], {})
        name = ref[len(prefix):]
        if name not in defs:
            raise ValueError(f"$ref {ref!r} names no definition")
        if ref in self.resolving:
            raise ValueError(f"recursive $ref {ref!r}: a recursive schema is not a regular language")
        self.resolving.append(ref)
        try:
            return self.compile(defs[name])
        finally:
            self.resolving.pop()


def json_schema_to_regex(schema: dict | str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    return SchemaCompiler(schema).compile(schema)
