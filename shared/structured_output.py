"""StructuredOutputsParams: the grammar one request's output must follow, with vLLM's names.

Exactly one kind is set. A JSON schema travels as its JSON text (every process sees the same
canonical string, which is also the compile cache's key); a dict given here is serialised once.
"""
import json as json_lib
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
        grammar library can honour it is checked where the library is: see
        `services.worker.grammar` and the gateway's validation.)"""
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
