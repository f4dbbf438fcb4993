"""Loading tools: from verl's tool YAML (`multi_turn.tool_config_path`) and from a file of typed Python
functions (`multi_turn.function_tool_path`), merged into one name -> tool mapping.

verl's YAML is `tools: [{class_name, config, tool_schema}]`; `class_name` is a dotted import path
("pkg.mod.Class") or a file path with the class after a colon ("path/to/tools.py:Class"). verl's own
built-in class names that rlsp implements (`VERL_TOOL_CLASSES`) load rlsp's class instead; any other
"verl." class name is refused. Every problem is a ValueError that starts with the config key and value it
came from.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from types import ModuleType
from typing import Any

import yaml

from rlsp.agent.tools.base import BaseTool, FunctionTool
from rlsp.utils.logging import get_logger, log_once

TOOL_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
FUNCTION_TOOL_KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"
# verl's tool `config.type`: native tools run in-process; MCP tools need an MCP client rlsp does not have.
_NATIVE_TYPES = ("native",)
# verl's built-in tool classes (both module layouts verl has used) -> the rlsp class that does the same.
VERL_TOOL_CLASSES: dict[str, str] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "rlsp.agent.tools.gsm8k.Gsm8kTool",
    "verl.workers.tool.gsm8k_tool.Gsm8kTool": "rlsp.agent.tools.gsm8k.Gsm8kTool",
}

log = get_logger("rlsp.agent.tools")


def import_file(path: str, where: str) -> ModuleType:
    """Import a Python file as a module (once per file; a second import returns the same module).

    `where` prefixes every error (the config key and value that named the file).
    """
    if not os.path.isfile(path):
        raise ValueError(f"{where}: file not found: {path!r}")
    full = os.path.realpath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(full))[0])
    # A name unique per file, so two files called tools.py never replace each other in sys.modules.
    module_name = f"rlsp_user_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, full)
    if spec is None or spec.loader is None:
        raise ValueError(f"{where}: {path!r} cannot be imported as a Python file (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses and pickling look the module up by name while it loads.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"{where}: importing {path!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(module_name: str, where: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while it runs
        raise ValueError(f"{where}: module {module_name!r} could not be imported: {type(exc).__name__}: {exc} "
                         "(it must be importable from the Python path, or name a file as "
                         "'path/to/file.py:ClassName')") from exc


def _verl_builtin(class_name: str, where: str) -> str:
    """`class_name`, or the rlsp class standing in for it when it names one of verl's built-in tools."""
    if class_name in VERL_TOOL_CLASSES:
        rlsp_name = VERL_TOOL_CLASSES[class_name]
        log_once(log, f"verl-tool:{class_name}", "tool class_name %s is verl's built-in tool: using rlsp's %s",
                 class_name, rlsp_name)
        return rlsp_name
    if class_name.startswith("verl."):
        raise ValueError(f"{where}: class_name {class_name!r} names a verl tool that is not built into rlsp (of "
                         f"verl's tools rlsp builds in only {', '.join(VERL_TOOL_CLASSES)}); point class_name at "
                         "your own rlsp.agent.tools.base.BaseTool subclass ('package.module.ClassName' or "
                         "'path/to/file.py:ClassName')")
    return class_name


def resolve_class(class_name: str, where: str) -> type[BaseTool]:
    """The BaseTool subclass that `class_name` names ("pkg.mod.Class" or "path/to/file.py:Class"); verl's
    built-in names in VERL_TOOL_CLASSES resolve to rlsp's classes."""
    class_name = _verl_builtin(class_name, where)
    if ":" in class_name:
        path, _, attr = class_name.rpartition(":")
        # "pkg.mod:Class" (entry-point style) names a module; anything with a path separator or .py, a file.
        if path.endswith(".py") or os.sep in path or "/" in path:
            module = import_file(path, where)
        else:
            module = _import_module(path, where)
    else:
        module_name, _, attr = class_name.rpartition(".")
        if not module_name or not attr:
            raise ValueError(f"{where}: class_name {class_name!r} must be 'package.module.ClassName' or "
                             "'path/to/file.py:ClassName'")
        module = _import_module(module_name, where)
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"{where}: {module.__name__!r} has no class {attr!r} (class_name {class_name!r})")
    if not isinstance(cls, type) or not issubclass(cls, BaseTool):
        raise ValueError(f"{where}: {class_name!r} is not a subclass of rlsp.agent.tools.base.BaseTool "
                         f"(got {cls!r}); tool classes must derive from BaseTool")
    return cls


def _entry_config(entry: dict[str, Any], where: str) -> dict[str, Any]:
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config must be a mapping, got {config!r}")
    kind = config.get("type", "native")
    if kind == "mcp":
        raise ValueError(f"{where}: config.type 'mcp' is refused: MCP tools are not supported (rlsp runs native "
                         "tools in-process); write the tool as a BaseTool subclass with config.type: native")
    if kind not in _NATIVE_TYPES:
        raise ValueError(f"{where}: config.type {kind!r} is not legal; legal: {', '.join(_NATIVE_TYPES)}")
    return config


def _build_entry(entry: Any, where: str) -> BaseTool:
    """One `tools:` entry of verl's YAML as a constructed tool."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each entry must be a mapping with class_name, config and tool_schema, "
                         f"got {entry!r}")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ValueError(f"{where}: missing class_name (e.g. 'rlsp.agent.tools.calculator.CalculatorTool')")
    if "tool_schema" not in entry:
        raise ValueError(f"{where}: {class_name!r} has no tool_schema (an OpenAI function schema "
                         "{type: function, function: {name, description, parameters}})")
    config = _entry_config(entry, where)
    cls = resolve_class(class_name, where)
    try:
        return cls(config=config, tool_schema=entry["tool_schema"])
    except Exception as exc:
        raise ValueError(f"{where}: constructing {class_name!r} raised {type(exc).__name__}: {exc}") from exc


def _read_tools_yaml(path: str, where: str) -> list[Any]:
    if not os.path.isfile(path):
        raise ValueError(f"{where}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ValueError(f"{where}: expected a mapping with a 'tools' list "
                         "(tools: [{class_name, config, tool_schema}, ...]), got "
                         f"{type(data).__name__}: {str(data)[:200]}")
    return data["tools"]


def load_tool_config(path: str) -> list[BaseTool]:
    """The tools that verl's tool YAML at `path` declares, constructed, in file order."""
    where = f"{TOOL_CONFIG_KEY}={path}"
    return [_build_entry(entry, f"{where}: tools[{i}]") for i, entry in enumerate(_read_tools_yaml(path, where))]


def load_function_tools(path: str) -> list[BaseTool]:
    """A FunctionTool for every public function defined in the Python file at `path`, in definition order."""
    where = f"{FUNCTION_TOOL_KEY}={path}"
    module = import_file(path, where)
    # Only functions defined in the file: ones it imports (helpers, libraries) are not tools.
    functions = [fn for name, fn in vars(module).items()
                 if not name.startswith("_") and inspect.isfunction(fn) and fn.__module__ == module.__name__]
    if not functions:
        raise ValueError(f"{where}: the file defines no public functions (names not starting with '_') "
                         "to use as tools")
    tools: list[BaseTool] = []
    for fn in functions:
        try:
            tools.append(FunctionTool(fn, source=path))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    return tools


def load_tools(tool_config_path: str | None, function_tool_path: str | None) -> dict[str, BaseTool]:
    """All tools of a run by name: the YAML's, then the function file's; a name may appear only once."""
    sources: list[tuple[str, BaseTool]] = []
    if tool_config_path:
        sources += [(f"{TOOL_CONFIG_KEY}={tool_config_path}", t) for t in load_tool_config(tool_config_path)]
    if function_tool_path:
        sources += [(f"{FUNCTION_TOOL_KEY}={function_tool_path}", t) for t in load_function_tools(function_tool_path)]
    tools: dict[str, BaseTool] = {}
    origin: dict[str, str] = {}
    for source, tool in sources:
        if tool.name in tools:
            raise ValueError(f"{source}: tool name {tool.name!r} is defined twice: by {origin[tool.name]} "
                             f"and by {source}; tool names must be unique")
        tools[tool.name], origin[tool.name] = tool, source
    return tools


def tool_schemas(tools: dict[str, BaseTool]) -> list[dict[str, Any]]:
    """The OpenAI schemas of `tools`, in their order (what the chat template is given as `tools=`)."""
    return [tool.get_openai_tool_schema() for tool in tools.values()]
