"""OpenAI tools on the request side: checking `tools` and `tool_choice`, the constraint that makes `required` and
a named function always produce valid arguments, and a tool prompt for chat templates that ignore `tools`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.structured_output.params import StructuredOutputsParams


@dataclass
class ToolChoice:
    mode: str                 # "none" | "auto" | "required" | "named"
    name: str | None = None   # the function, when named


def check_tools(tools: list | None) -> dict[str, dict]:
    """name -> function object; ValueError naming the field for anything malformed."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if name in functions:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        functions[name] = fn
    return functions


def resolve_tool_choice(tool_choice, functions: dict[str, dict], auto_enabled: bool) -> ToolChoice:
    """OpenAI's rules with vLLM's server switch: with tools and no choice, `auto`; `auto` needs the server
    started with --enable-auto-tool-choice and a --tool-call-parser."""
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ValueError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}")
        if name not in functions:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return ToolChoice("named", name)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}")
    if tool_choice != "none" and not functions:
        raise ValueError(f"tool_choice is {tool_choice!r} but no tools are given")
    if tool_choice == "auto" and not auto_enabled:
        raise ValueError("tool_choice is \"auto\", which needs the server started with --enable-auto-tool-choice "
                         "and --tool-call-parser")
    return ToolChoice(tool_choice)


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def tool_constraint(choice: ToolChoice, functions: dict[str, dict],
                    parallel_tool_calls: bool = True) -> tuple[StructuredOutputsParams, str] | None:
    """The JSON the output must be, and the field to blame if a parameters schema is invalid. A named function:
    its arguments object. `required`: a list of {"name", "parameters"} calls (vLLM's form), name first, so the
    name can be streamed before the arguments."""
    if choice.mode == "named":
        return (StructuredOutputsParams(json=_parameters(functions[choice.name])),
                f"tools[{choice.name}].function.parameters")
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                "parameters": _parameters(fn)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, fn in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema), "tools[].function.parameters"


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tool_system_prompt(functions: dict[str, dict]) -> str:
    """For a chat template that ignores `tools` (SmolLM2's does): the functions and the <tool_call> format the
    hermes parser reads, as a system message."""
    lines = "\n".join(json.dumps({"type": "function", "function": fn}, ensure_ascii=False)
                      for fn in functions.values())
    return ("You can call functions to help answer. These are the functions, one JSON object per line:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call a function, answer with a JSON object inside <tool_call></tool_call> tags, one per call:\n"
            "<tool_call>\n{\"name\": \"function name\", \"arguments\": {\"argument\": \"value\"}}\n</tool_call>")


def messages_without_tool_support(messages: list[dict], functions: dict[str, dict]) -> list[dict]:
    """Messages for a template that knows only role and content: the tool prompt joins the system message,
    earlier assistant tool calls and tool results become text in the same <tool_call> / <tool_response> form."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "".join(f"<tool_call>\n{json.dumps(_call_dict(c), ensure_ascii=False)}\n</tool_call>"
                            for c in m.pop("tool_calls"))
            m["content"] = (m.get("content") or "") + calls
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.setdefault("content", "")
        if m["content"] is None:
            m["content"] = ""
        out.append(m)
    if functions:
        prompt = tool_system_prompt(functions)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_dict(call: dict) -> dict:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return {"name": fn.get("name"), "arguments": args}
