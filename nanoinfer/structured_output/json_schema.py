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
import functools
import json
import re
from urllib.parse import unquote

from nanoinfer.structured_output.dfa import compile_regex
from nanoinfer.structured_output.regex import parse, to_regex
from nanoinfer.structured_output.schema_merge import (ANNOTATIONS, Unsatisfiable, as_enum, count,
                                                      dumps, merge, without)

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
KEYWORDS = {"type", "enum", "const", "anyOf", "allOf", "$ref"}.union(*TYPE_KEYWORDS.values())
MAX_REGEX_CHARS = 200_000
ANY_DEPTH = 2
NOT_RAW_IN_STRINGS = [(0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))]   # JSON escapes


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


def bounds(schema: dict, what: str) -> tuple[int, int | None]:
    """minX and maxX (None: no bound) of Items or Length."""
    lo, hi = count(schema, "min" + what), schema.get("max" + what)
    if hi is not None and count(schema, "max" + what) < lo:
        raise Unsatisfiable(f"JSON schema with max{what} < min{what} matches nothing")
    return lo, hi


class SchemaCompiler:
    def __init__(self, root):
        self.root = root
        self.resolving = []

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
        schema = as_enum(schema)
        if unknown := set(schema) - KEYWORDS - ANNOTATIONS:
            raise ValueError(f"unsupported JSON schema keyword {sorted(unknown)[0]!r}")
        for key in ("enum", "anyOf", "allOf", "type"):
            if schema.get(key) == []:
                raise Unsatisfiable(f"JSON schema keyword {key!r} with an empty list matches "
                                    "nothing")
        if "$ref" in schema:
            return self.ref(schema)
        if "allOf" in schema:   # the other keywords merged with each schema of allOf in turn
            return self.compile(functools.reduce(merge, schema["allOf"], without(schema, "allOf")))
        if "anyOf" in schema:
            return self.any_of(schema)
        if "enum" in schema:
            return self.enum(schema)
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
        regexes = []
        error = None
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
        return self.alternatives([lambda b=b: self.compile(merge(rest, b))
                                  for b in schema["anyOf"]])

    def enum(self, schema: dict) -> str:
        """The values that the sibling keywords allow too."""
        values = schema["enum"]
        rest = without(schema, "enum")
        if not isinstance(values, list):
            raise ValueError(f"JSON schema keyword 'enum' must be a list, got {values!r}")
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
            lo, hi = bounds(schema, "Length")
            return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'
        if type_ not in SCALARS:
            raise ValueError(f"unsupported JSON schema type {type_!r}")
        return SCALARS[type_]

    def array(self, schema: dict) -> str:
        lo, hi = bounds(schema, "Items")
        items = schema.get("items", True)
        if not isinstance(items, (dict, bool)):
            raise ValueError(f"unsupported JSON schema 'items' {items!r}: it must be a schema")
        if items is False and lo:
            raise Unsatisfiable("JSON schema with items false and minItems > 0 matches nothing")
        if items is False:
            hi = 0
        return rf"\[{repeat(self.compile(items) if hi != 0 else '', lo, hi)}\]"

    def object(self, schema: dict) -> str:
        extra = schema.get("additionalProperties", True)
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"JSON schema keyword 'properties' must be an object, got {props!r}")
        required = schema.get("required", [])
        names = [*required, *props] if isinstance(required, list) else [None]
        if not all(isinstance(name, str) for name in names):
            raise ValueError(f"JSON schema property names must be strings, got {required!r}")
        # (a required property without a schema of its own: additionalProperties' is its schema)
        props = props | {name: extra for name in required if name not in props}
        if not props and extra is not False:   # any object, its values following `extra`
            return rf"\{{{repeat(f'{STRING}:{WS}{self.compile(extra)}', 0, None)}\}}"
        parts = []
        for name, sub in props.items():
            try:
                parts.append((literal(name) + ":" + WS + self.compile(sub), name in required))
            except Unsatisfiable:
                if name in required:
                    raise

        def after(i: int) -> str:   # properties i.. when one was written before them
            return "".join(f"{SEP}{p}" if req else f"({SEP}{p})?" for p, req in parts[i:])

        def first(i: int) -> str:   # properties i.. when none was written yet
            if i == len(parts):
                return ""
            p, req = parts[i]
            return p + after(i + 1) if req else f"({p}{after(i + 1)}|{first(i + 1)})"
        return rf"\{{{first(0)}\}}"   # (no property that can be written: `{}`)

    def ref(self, schema: dict) -> str:
        """A local JSON pointer (#/...), with the keywords beside it."""
        ref = schema["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"unsupported $ref {ref!r}: only JSON pointers into the schema "
                             "(#/...)")
        target = self.root
        try:
            for part in unquote(ref[2:]).split("/") if ref != "#" else []:
                part = part.replace("~1", "/").replace("~0", "~")
                target = target[int(part)] if isinstance(target, list) else target[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise ValueError(f"$ref {ref!r} names nothing in the schema") from None
        if ref in self.resolving:
            raise ValueError(f"recursive $ref {ref!r}: a recursive schema is not a regular "
                             "language")
        self.resolving.append(ref)
        try:
            return self.compile(merge(without(schema, "$ref"), target))
        finally:
            self.resolving.pop()


def json_schema_to_regex(schema: dict | str) -> str:
    """The schema's regex; a ValueError names what is not supported. An `$id` may only stand at
    the root: below it, it would change what the `$ref`s inside mean."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    if isinstance(schema, dict):
        schema = without(schema, "$id")
    try:
        return SchemaCompiler(schema).compile(schema)
    except (TypeError, AttributeError, KeyError, RecursionError) as e:   # a keyword's wrong type
        raise ValueError(f"malformed JSON schema ({type(e).__name__}: {e})") from e
