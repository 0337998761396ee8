"""Tool calls: `tools` and `tool_choice` in, `tool_calls` out, in DeepSeek's format.

DeepSeek-V3 (and V3.1, and the `moemesh init-model` templates) write a turn's calls as
special tokens around plain text:

    <｜tool▁calls▁begin｜>
      <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS-JSON<｜tool▁call▁end｜>   (one or more)
    <｜tool▁calls▁end｜>

(V3's first release wrote `function<｜tool▁sep｜>NAME` then the arguments in a ```json
fence; the parser reads that too.) The chat template renders `tools` and the `tool` role
messages; this module turns the generated tokens back into OpenAI's `tool_calls`, token by
token, so a stream can send them as deltas. The markers are found by token id, never by
text: a model cannot spell a marker out of ordinary text.

With tool_choice `required` or a named function the call is guaranteed: the request gets
a Lark grammar (the markers by id, each function's name, its parameters as an embedded
JSON Schema) that the workers enforce when sampling, as for response_format.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from moemesh.shared.grammar.compile import GrammarError, check, json_schema_block
from moemesh.shared.protocol.messages import GrammarSpec
from moemesh.shared.tokenizer.tokenizer import Tokenizer

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁sep｜>")


# Error codes of the refusals a JSON schema of the request cannot foresee (the OpenAPI
# document names them): settings that disagree with each other, and a function's
# parameters that the grammar library cannot enforce.
MISMATCH, UNENFORCEABLE = "tool_mismatch", "unenforceable_schema"


class ToolError(ValueError):
    """A bad tools / tool_choice / parallel_tool_calls; `param` names which."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Markers:
    calls_begin: int
    calls_end: int
    call_begin: int
    call_end: int
    sep: int

    @classmethod
    def of(cls, tok: Tokenizer) -> "Markers | None":
        ids = [tok.token_to_id(m) for m in MARKERS]
        return None if None in ids else cls(*ids)


@dataclass(frozen=True)
class Tools:
    tools: list[dict]  # as the template renders them (validated)
    choice: str  # auto | required | function ("none" never gets here)
    name: str | None  # the function tool_choice names
    parallel: bool
    markers: Markers

    def grammar(self) -> GrammarSpec | None:
        """The constraint that guarantees a call (required, a named function), else None."""
        if self.choice == "auto":
            return None
        fns = [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.name]
        m = self.markers
        alts = " | ".join(f"fn_{i}" for i in range(len(fns)))
        lines = [f"start: <[{m.calls_begin}]> call{'+' if self.parallel else ''} <[{m.calls_end}]>",
                 f"call: <[{m.call_begin}]> ({alts}) <[{m.call_end}]>"]
        for i, f in enumerate(fns):
            lines.append(f'fn_{i}: "{f["name"]}" <[{m.sep}]> {json_schema_block(f.get("parameters") or {"type": "object"})}')
        return GrammarSpec("lark", "\n".join(lines))


def parse_tools(body: dict, tok: Tokenizer) -> Tools | None:
    """The request's tool settings, None when no tool may be called. Raises ToolError."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "'tool_choice' needs 'tools'", MISMATCH)
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", "'tools' must be an array of function tools")
    norm = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in norm]
    if len(set(names)) != len(names):
        raise ToolError("tools", "'tools' has two functions of the same name", MISMATCH)
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError("tool_choice", "'tool_choice' must be none, auto, required or "
                                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        name = fn["name"]
        if name not in names:
            raise ToolError("tool_choice", f"'tool_choice' names {name!r}, which is not in 'tools'", MISMATCH)
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice", "'tool_choice' must be none, auto, required or a named function")
    if choice == "none":
        return None
    markers = Markers.of(tok)
    if markers is None:
        raise ToolError("tools", "this model's tokenizer has no tool-call tokens; tools are not supported")
    out = Tools(norm, choice, name, True if parallel is None else parallel, markers)
    spec = out.grammar()
    if spec is not None:
        try:
            check(spec)
        except GrammarError as e:
            raise ToolError("tools", f"a function's parameters cannot be enforced: {e}", UNENFORCEABLE) from None
    return out


def _tool(i: int, t) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise ToolError("tools", f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}")
    f = t["function"]
    if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
        raise ToolError("tools", f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(f.get("description", ""), (str, type(None))):
        raise ToolError("tools", f"'{where}.function.description' must be a string")
    if not isinstance(f.get("parameters", {}), (dict, type(None))):
        raise ToolError("tools", f"'{where}.function.parameters' must be a JSON Schema object")
    if not isinstance(f.get("strict", False), (bool, type(None))):
        raise ToolError("tools", f"'{where}.function.strict' must be a boolean")
    fn = {"name": f["name"], "description": f.get("description") or "", "parameters": f.get("parameters") or {}}
    return {"type": "function", "function": fn}


# ---- output ------------------------------------------------------------------------------
@dataclass
class Delta:
    """One piece of a streamed answer: content text, the start of a call (its id and name),
    or a piece of a call's arguments."""
    content: str = ""
    index: int = -1  # the call's index, for a call's start and its arguments
    call_id: str = ""  # set on a call's start
    name: str = ""  # set on a call's start
    arguments: str = ""


@dataclass
class ToolCallParser:
    """Generated tokens -> content and tool calls, one token at a time.

    States: content -> (calls begin) between -> (call begin) name -> (sep) arguments ->
    (call end) between ... -> (calls end) after. Text outside the calls section is the
    message's content; text after it (none, from DeepSeek) is dropped."""
    markers: Markers
    calls: list[dict] = field(default_factory=list)  # OpenAI's tool_calls, complete so far
    _state: str = "content"
    _buf: str = ""

    def feed(self, token_id: int, text: str) -> list[Delta]:
        m, st = self.markers, self._state
        if st == "content":
            if token_id == m.calls_begin:
                self._state = "between"
                return []
            return [Delta(content=text)] if text else []
        if st == "between":
            if token_id == m.call_begin:
                self._state, self._buf = "name", ""
            elif token_id == m.calls_end:
                self._state = "after"
            return []
        if st == "name":
            if token_id == m.sep:
                name = self._buf.strip()
                if name == "function":  # V3's first format: NAME, then the arguments in a fence
                    self._state, self._buf = "fenced", ""
                    return []
                self._state = "arguments"
                return [self._start(name)]
            self._buf += text
            return []
        if st == "arguments":
            if token_id == m.call_end:
                self._state = "between"
                return []
            if text:
                self.calls[-1]["function"]["arguments"] += text
                return [Delta(index=len(self.calls) - 1, arguments=text)]
            return []
        if st == "fenced":
            if token_id != m.call_end:
                self._buf += text
                return []
            self._state = "between"
            name, _, rest = self._buf.partition("\n")
            args = rest.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
            start = self._start(name.strip())
            self.calls[-1]["function"]["arguments"] = args
            return [start, Delta(index=start.index, arguments=args)] if args else [start]
        return []

    def _start(self, name: str) -> Delta:
        call_id = f"call_{random.getrandbits(96):024x}"
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        return Delta(index=len(self.calls) - 1, call_id=call_id, name=name)

