"""Function tools in the prompt and tool calls out of the generated text (Hermes style).

The tiny chat template knows only `role` and `content`, so the gateway renders:
- `tools` (with `tool_choice` other than "none") as a block appended to the first
  system message (or a new system message first), listing each tool as JSON inside
  `<tools></tools>` and asking for `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`; "required" adds "You must call at least one function.", a named choice
  "You must call the function NAME." (an instruction only: decoding is not constrained).
- an assistant message with `tool_calls`: if the gateway produced this message for the
  run (same content, tool names and arguments as JSON values: `message_key`), the text
  the model generated; otherwise its content, then one `<tool_call>\\n{"name", "arguments"}\\n
  </tool_call>` block per call, joined by newlines.
- a `tool` message: role "tool", content `<tool_response>\\nCONTENT\\n</tool_response>`.
Generated text is parsed (when tools are active) by `parse_tool_calls`: every
`<tool_call>` block holding a JSON object with a string "name" and an object (or absent)
"arguments" becomes a tool call; a malformed block stays in the text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gyre_slurm.gateway.errors import RequestError

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_TOOLS = 128

PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
INSTRUCTION = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict[str, Any], ...]  # the request's tool objects, as given
    choice: str  # "auto" | "none" | "required" | "named"
    name: str | None = None  # the function of a named choice

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"


NO_TOOLS = ToolSpec((), "none")


def parse_tools(body: dict[str, Any]) -> ToolSpec:
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise RequestError("'functions'/'function_call' are not supported: use 'tools' and "
                           "'tool_choice'")
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} function tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                               "{\"name\", \"description\", \"parameters\"}}")
        if not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise RequestError(f"tools[{i}].function.name must be 1-64 of A-Z a-z 0-9 _ . : -")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    choice = body.get("tool_choice")
    if choice is None:
        return ToolSpec(tuple(tools), "auto" if tools else "none")
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise RequestError("tool_choice 'required' needs a non-empty 'tools'")
        return ToolSpec(tuple(tools), choice)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" \
            or not isinstance(fn.get("name"), str):
        raise RequestError("tool_choice must be 'auto', 'none', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in names:
        raise RequestError(f"tool_choice names function {fn['name']!r}, which is not in "
                           f"'tools' ({', '.join(names) or 'none given'})")
    return ToolSpec(tuple(tools), "named", fn["name"])


def system_block(spec: ToolSpec) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in spec.tools)
    out = PREAMBLE + lines + INSTRUCTION
    if spec.choice == "required":
        out += "\n\nYou must call at least one function."
    elif spec.choice == "named":
        out += f"\n\nYou must call the function {spec.name}."
    return out


def call_block(name: str, arguments: str) -> str:
    try:
        args: Any = json.loads(arguments)
    except (ValueError, RecursionError):  # a client's text, nested as deep as it likes
        args = arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args},
                                        ensure_ascii=False) + "\n</tool_call>"


def canonical_arguments(arguments: str) -> str:
    """Arguments compared by meaning: JSON re-serialised canonically (key order,
    spacing and escapes do not matter), or the text itself when it is not JSON."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False)
    except (ValueError, RecursionError):
        return arguments


def message_key(content: str | None, tool_calls: Sequence[dict[str, str]]) -> str:
    """What identifies an assistant message with tool calls the gateway answered, as a
    client sends it back: its content (surrounding whitespace aside) and each call's
    name and arguments compared as JSON values. Clients re-serialise arguments
    (pydantic-ai sends `{"city":"Paris"}` for the `{"city": "Paris"}` it got) and some
    rewrite call ids, so neither the argument text nor the ids are part of the key."""
    return json.dumps([(content or "").strip(), [[c["name"], canonical_arguments(c["arguments"])]
                                                for c in tool_calls]], ensure_ascii=False)


def render_messages(messages: Sequence[dict[str, Any]], spec: ToolSpec,
                    said: Callable[[str], str | None]) -> list[dict[str, str]]:
    """Parsed messages -> the template's {role, content} messages (see the docstring).
    `said(key)` is the generated text of an assistant message the gateway answered."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m["content"] or ""
        if m["role"] == "assistant" and m["tool_calls"]:
            raw = said(message_key(m["content"], m["tool_calls"]))
            content = raw if raw is not None else "\n".join(
                ([content] if content else [])
                + [call_block(c["name"], c["arguments"]) for c in m["tool_calls"]])
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if spec.active:
        block = system_block(spec)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]["content"]
            out[0] = {"role": out[0]["role"], "content": f"{first}\n\n{block}" if first
                      else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _one_call(inner: str) -> dict[str, str] | None:
    try:
        obj = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, str]]]:
    """(remaining content stripped, or None when empty; [{"id", "name", "arguments"}]).
    Without a well-formed block: (text unchanged, [])."""
    calls, kept, pos = [], [], 0
    for m in TOOL_CALL.finditer(text):
        call = _one_call(m.group(1).strip())
        if call is None:
            continue  # stays in the text
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", **call})
    if not calls:
        return text, []
    content = ("".join(kept) + text[pos:]).strip()
    return content or None, calls
