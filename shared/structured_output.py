"""StructuredOutputsParams: the grammar one request's output must follow, with vLLM's names.

Exactly one kind is set. A JSON schema travels as its JSON text (every process sees the same
canonical string, which is also the compile cache's key); a dict given here is serialised once.
"""
import functools
import json as json_lib
import re
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema (its JSON text; a dict is accepted and serialised)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF-style, as xgrammar reads it)
    json_object: bool = False  # any JSON object
    structural_tag: str | None = None  # xgrammar structural tag (JSON text)
    # No whitespace between JSON tokens beyond single spaces (vLLM's field of the same name).
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if isinstance(self.json, dict):
            self.json = json_lib.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.verify()

    @property
    def kind(self) -> str:
        for name in KINDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name
        raise AssertionError("verify() guarantees one kind")

    def verify(self) -> None:
        """Raise SamplingParamsError unless exactly one well-formed kind is set. (Whether the
        grammar library can honour it: `check_supported`.)"""
        from shared.sampling_params import SamplingParamsError  # it imports this module
        field = "structured_outputs"
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise SamplingParamsError(field, f"exactly one of {', '.join(KINDS)} must be set, "
                                             f"got {set_kinds or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, str):
                raise SamplingParamsError(f"{field}.json", "must be a JSON schema object")
            try:
                schema = json_lib.loads(self.json)
            except ValueError as e:
                raise SamplingParamsError(f"{field}.json", f"is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamsError(f"{field}.json", "must be a JSON schema object")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"{field}.{name}", "must be a non-empty string")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError(f"{field}.choice", "must be a non-empty list of "
                                                         "non-empty strings")


# -- what xgrammar compiles ------------------------------------------------------------------------

_MAX_WHITESPACE = 12  # characters between two JSON tokens

def grammar_source(params: StructuredOutputsParams) -> tuple[str, str, tuple]:
    """(xgrammar source kind, its text, compile options as sorted (name, value) pairs): what the
    worker compiles and what `check_supported` parses. The triple is also the compile cache's key."""
    kind = params.kind
    # Whitespace between JSON tokens: any (up to a newline and a 2-level indent: sampled at high
    # temperature, unbounded whitespace can fill the whole max_tokens), or single spaces only.
    whitespace = ((("any_whitespace", True), ("max_whitespace_cnt", _MAX_WHITESPACE))
                  if not params.disable_any_whitespace else (("any_whitespace", False),))
    if kind == "json":
        return "json_schema", params.json, whitespace
    if kind == "json_object":
        # Not strict: any properties, while an object it must be (xgrammar's builtin JSON
        # grammar would also take arrays and scalars).
        return "json_schema", '{"type":"object"}', whitespace + (("strict_mode", False),)
    if kind == "regex":
        return "regex", params.regex, ()
    if kind == "choice":
        # JSON string literals are EBNF string literals (\" \\ \n \uXXXX escapes).
        alternatives = " | ".join(json_lib.dumps(c, ensure_ascii=False) for c in params.choice)
        return "ebnf", f"root ::= {alternatives}", ()
    if kind == "grammar":
        return "ebnf", params.grammar, ()
    return "structural_tag", params.structural_tag, ()


# -- what xgrammar cannot honour -------------------------------------------------------------------

# JSON-schema keywords that xgrammar 0.2.8 parses but does not enforce: a schema with one of them
# compiles, yet output that breaks the keyword is accepted (found by matching violating strings
# against compiled schemas). They are refused; a constraint is never relaxed silently.
_UNENFORCED = {
    "contains": "array 'contains'", "minContains": "array 'contains'",
    "maxContains": "array 'contains'",
    "if": "conditional subschemas", "then": "conditional subschemas",
    "else": "conditional subschemas",
    "not": "negated subschemas",
    "dependentRequired": "dependent properties", "dependentSchemas": "dependent properties",
    "dependencies": "dependent properties",
    "contentEncoding": "string content encodings", "contentMediaType": "string content types",
    "contentSchema": "string content schemas",
    "$dynamicRef": "dynamic references", "$recursiveRef": "recursive references",
}
# String formats xgrammar 0.2.8 enforces; others (iri, idn-email, regex, ...) it ignores.
_ENFORCED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "propertyNames", "contains",
               "not", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties")


def _schema_problem(schema, path: str) -> str | None:
    """The first keyword of `schema` (at JSON pointer `path`) that xgrammar would not enforce."""
    if not isinstance(schema, dict):
        return None

    def refuse(keyword: str, why: str) -> str:
        return f"JSON schema keyword '{keyword}' at {path} is not supported ({why})"

    for keyword, what in _UNENFORCED.items():
        if keyword in schema:
            return refuse(keyword, f"{what} would not be enforced")
    if schema.get("uniqueItems") is True:
        return refuse("uniqueItems", "unique items would not be enforced")
    for keyword in ("unevaluatedItems", "unevaluatedProperties"):
        if keyword in schema and schema[keyword] is not True:
            return refuse(keyword, "it would not be enforced")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return refuse("$ref", f"only references inside the schema ('#...'), got {ref!r}")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return refuse("allOf", "only one subschema; more would not all be enforced")
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint_by_type(one_of):
        return refuse("oneOf", "branches that may overlap would be matched as 'anyOf'; give each "
                               "branch its own 'type'")
    if "multipleOf" in schema and schema.get("type") != "integer":
        return refuse("multipleOf", "only on integers")
    fmt = schema.get("format")
    if fmt is not None and fmt not in _ENFORCED_FORMATS:
        return refuse("format", f"format {fmt!r} would not be enforced; enforced formats: "
                                f"{', '.join(sorted(_ENFORCED_FORMATS))}")
    for limit in ("minLength", "maxLength"):
        for other in ("pattern", "format"):
            if limit in schema and other in schema:
                return refuse(limit, f"a length limit together with '{other}' would not be "
                                     f"enforced")
    required, properties = schema.get("required"), schema.get("properties")
    if (isinstance(required, list) and isinstance(properties, dict)
            and schema.get("additionalProperties", False) is False
            and "patternProperties" not in schema):
        missing = [name for name in required if name not in properties]
        if missing:
            return refuse("required", f"{missing[0]!r} is not among the declared properties")

    for keyword in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                problem = _schema_problem(sub, f"{path}/{keyword}/{_pointer_escape(name)}")
                if problem:
                    return problem
    for keyword in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                problem = _schema_problem(sub, f"{path}/{keyword}/{i}")
                if problem:
                    return problem
    for keyword in _SUBSCHEMAS:
        problem = _schema_problem(schema.get(keyword), f"{path}/{keyword}")
        if problem:
            return problem
    return None


def _disjoint_by_type(branches: list) -> bool:
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if not all(isinstance(t, str) for t in types) or len(set(types)) != len(types):
        return False
    return not {"integer", "number"} <= set(types)  # every integer is a number


def _pointer_escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[12:00:00] /project/cpp/x.cc:83: "


def check_supported(params: StructuredOutputsParams) -> None:
    """Raise SamplingParamsError naming what the grammar library (xgrammar) cannot honour: an
    invalid regex, EBNF grammar, structural tag or JSON schema, or a JSON-schema keyword it would
    ignore. Parses the grammar (no tokenizer needed) but does not compile it. A large schema
    takes tens of milliseconds to parse, and both the gateway and the engine check every
    request, so the verdicts of recent grammars are kept (requests often repeat their tools)."""
    from shared.sampling_params import SamplingParamsError
    kind, text, options = grammar_source(params)
    # Only grammars of ordinary size are kept (the cache holds their text).
    check = _grammar_problem if len(text) <= _CACHED_TEXT_MAX else _grammar_problem.__wrapped__
    problem = check(params.kind, kind, text, options)
    if problem is not None:
        raise SamplingParamsError(*problem)


_CACHED_TEXT_MAX = 64 * 1024  # characters


@functools.lru_cache(maxsize=256)
def _grammar_problem(request_kind: str, kind: str, text: str, options: tuple
                     ) -> tuple[str, str] | None:
    """(field, message) of what check_supported refuses in a grammar, or None."""
    import xgrammar

    field = f"structured_outputs.{request_kind}"
    if request_kind == "json":
        problem = _schema_problem(json_lib.loads(text), "#")
        if problem:
            return field, problem
    parse = {"json_schema": xgrammar.Grammar.from_json_schema,
             "regex": xgrammar.Grammar.from_regex,
             "ebnf": xgrammar.Grammar.from_ebnf,
             "structural_tag": xgrammar.Grammar.from_structural_tag}[kind]
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
            "choice": "choice", "grammar": "EBNF grammar",
            "structural_tag": "structural tag"}[request_kind]
    try:
        parse(text, **dict(options))
    except Exception as e:  # xgrammar raises RuntimeError, ValueError and its own errors
        message = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else "")
        return field, f"invalid {what}: {message or type(e).__name__}"
    return None
