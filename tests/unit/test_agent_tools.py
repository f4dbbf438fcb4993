"""Agent tools: the calculator against Python arithmetic, tool YAML and function-file loading with every error,
and ToolSession's concurrency, timeouts, faults, truncation, per-trajectory state and release."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from rlsp.agent.tools.base import BaseTool, FunctionTool, ToolResponse
from rlsp.agent.tools.calculator import CALCULATOR_SCHEMA, CalculatorTool
from rlsp.agent.tools.loading import (
    FUNCTION_TOOL_KEY,
    TOOL_CONFIG_KEY,
    import_file,
    load_function_tools,
    load_tool_config,
    load_tools,
    tool_schemas,
)
from rlsp.agent.tools.session import ToolResult, ToolSession, truncate_text
from rlsp.agent.types import ToolCall

ALLOWED = "use only numbers, + - * / // % ** and parentheses"


def calc(expression: Any, **config: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
    return asyncio.run(CalculatorTool(config).execute("id", {"expression": expression}))


@pytest.mark.parametrize("expression, value", [
    ("1 + 2", 1 + 2), ("123456789*987654321", 123456789 * 987654321), ("2**100", 2 ** 100),
    ("-(3 - 10) * 4", -(3 - 10) * 4), ("7 // 2", 7 // 2), ("-7 // 2", -7 // 2), ("-7 % 3", -7 % 3),
    ("2 ** -2", 2 ** -2), ("0.1 + 0.2", 0.1 + 0.2), ("1 / 3", 1 / 3), ("((2 + 3) * (4 - 1)) ** 2", 225),
    ("+5 - -5", 10), ("99999999999999999999 * 99999999999999999999", 99999999999999999999 ** 2),
    ("2 ** 332", 2 ** 332), ("7.5 % 2", 7.5 % 2), ("10 ** 99 - 1", 10 ** 99 - 1), ("3 ** 2 ** 2", 81),
])
def test_calculator_matches_python(expression: str, value: int | float) -> None:
    expected = repr(value) if isinstance(value, float) else str(value)
    assert calc(expression) == (ToolResponse(text=expected), 0.0, {"calculator/error": 0.0})


def test_calculator_integral_results_print_as_ints_and_reward_on_success() -> None:
    assert calc("10 / 2", reward_on_success=0.5) == (ToolResponse(text="5"), 0.5, {"calculator/error": 0.0})
    assert calc("1e15")[0].text == "1000000000000000"
    assert calc("2.0 ** 54")[0].text == repr(2.0 ** 54)  # past 2**53 a float keeps its float form


@pytest.mark.parametrize("expression, error", [
    ("x + 1", f"names are not allowed (found 'x'); {ALLOWED}"),
    ("__import__('os').system('true')", f"function calls are not allowed; {ALLOWED}"),
    ("abs(-1)", f"function calls are not allowed; {ALLOWED}"),
    ("(1).real", f"attribute access is not allowed; {ALLOWED}"),
    ("(lambda: 1)", f"Lambda is not allowed; {ALLOWED}"),
    ("[i for i in (1, 2)]", f"ListComp is not allowed; {ALLOWED}"),
    ("'a' * 3", f"only numbers are allowed, found 'a'; {ALLOWED}"),
    ("True + 1", f"only numbers are allowed, found True; {ALLOWED}"),
    ("1 << 3", f"the operator LShift is not allowed; {ALLOWED}"),
    ("1 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0.0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("9**9**9", "the result has more than 100 digits"), ("10 ** 100", "the result has more than 100 digits"),
    ("(10 ** 60) * (10 ** 60)", "the result has more than 100 digits"),
    ("0.5 ** -1000", "the result has more than 100 digits"), ("1e400", "the result is too large (not a finite number)"),
    ("(-8) ** 0.5", f"the result {(-8) ** 0.5!r} is not a real number"),
    ("1 +", "not a valid expression (invalid syntax)"),
    ("1+" * 100 + "1", "the expression has 201 characters; at most 200 are allowed"),
])
def test_calculator_refusals(expression: str, error: str) -> None:
    start = time.perf_counter()
    assert calc(expression) == (ToolResponse(text=f"Error: {error}"), 0.0, {"calculator/error": 1.0})
    # Refused before computing: microseconds. 9**9**9 computed would take hours; 5 s tells the two apart on
    # any machine, however slow or busy.
    assert time.perf_counter() - start < 5.0


def test_calculator_config_bounds() -> None:
    assert calc("2 ** 40", max_digits=13)[0].text == "1099511627776"  # 13 digits
    assert calc("2 ** 40", max_digits=12)[0].text == "Error: the result has more than 12 digits"
    assert calc("1+2+3", max_expression_chars=4)[0].text == "Error: the expression has 5 characters; at most 4 are allowed"
    assert calc(42)[0].text == "Error: the 'expression' parameter must be a string, got 42"
    with pytest.raises(ValueError) as err:
        CalculatorTool({"max_digits": 0})
    assert str(err.value) == "CalculatorTool config max_digits=0: must be an integer from 1 to 4300"


USER_TOOL = '''
from rlsp.agent.tools.base import BaseTool, ToolResponse

class EchoTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=self.config.get("prefix", "") + parameters["text"]), 0.0, {}

class BrokenTool(BaseTool):
    def __init__(self, config, tool_schema):
        raise RuntimeError("boom")

class NotATool:
    pass
'''


def schema(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                             "parameters": {"type": "object", "properties": {}}}}


def write_yaml(tmp_path: Path, body: str) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(body))
    return str(path)


def entry(class_name: str, name: str, config: str = "{}") -> str:
    return f"""
      - class_name: {class_name}
        config: {config}
        tool_schema: {{type: function, function: {{name: {name}, description: d, parameters: {{type: object}}}}}}"""


def test_yaml_calculator_and_user_classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_tools.py").write_text(USER_TOOL)
    (tmp_path / "rlsp_test_tools_mod.py").write_text(USER_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rlsp_test_tools_mod", raising=False)
    path = write_yaml(tmp_path, "tools:" + entry("rlsp.agent.tools.calculator.CalculatorTool", "calculator",
                                                 "{type: native, max_digits: 7}")
                      + entry(f"{tmp_path}/user_tools.py:EchoTool", "echo", "{prefix: '> '}")
                      + entry("rlsp_test_tools_mod.EchoTool", "echo2"))
    calc_tool, echo, echo2 = load_tool_config(path)
    assert (type(calc_tool), calc_tool.name, calc_tool.max_digits) == (CalculatorTool, "calculator", 7)
    assert (type(echo).__name__, echo.name, echo2.name) == ("EchoTool", "echo", "echo2")
    assert echo.get_openai_tool_schema() == {"type": "function", "function": {
        "name": "echo", "description": "d", "parameters": {"type": "object"}}}
    assert asyncio.run(echo.execute("i", {"text": "hi"}))[0] == ToolResponse(text="> hi")
    assert type(echo2).__module__ == "rlsp_test_tools_mod"


@pytest.mark.parametrize("body, error", [
    ("tools: [unclosed", None),
    ("foo: 1", "expected a mapping with a 'tools' list (tools: [{class_name, config, tool_schema}, ...]), "
               "got dict: {'foo': 1}"),
    ("tools:\n  - config: {}", "tools[0]: missing class_name (e.g. 'rlsp.agent.tools.calculator.CalculatorTool')"),
    ("tools:\n  - class_name: a.B", "tools[0]: 'a.B' has no tool_schema (an OpenAI function schema "
                                    "{type: function, function: {name, description, parameters}})"),
    ("tools:" + entry("no_such_pkg_xyz.Tool", "t"), "tools[0]: module 'no_such_pkg_xyz' could not be imported: "
     "ModuleNotFoundError: No module named 'no_such_pkg_xyz' (it must be importable from the Python path, or "
     "name a file as 'path/to/file.py:ClassName')"),
    ("tools:" + entry("rlsp.agent.tools.calculator.NoSuch", "t"),
     "tools[0]: 'rlsp.agent.tools.calculator' has no class 'NoSuch' (class_name "
     "'rlsp.agent.tools.calculator.NoSuch')"),
    ("tools:" + entry("collections.OrderedDict", "t"), "tools[0]: 'collections.OrderedDict' is not a subclass of "
     "rlsp.agent.tools.base.BaseTool (got <class 'collections.OrderedDict'>); tool classes must derive from BaseTool"),
    ("tools:" + entry("rlsp.agent.tools.calculator.CalculatorTool", "t", "{type: mcp}"),
     "tools[0]: config.type 'mcp' is refused: MCP tools are not supported (rlsp runs native tools in-process); "
     "write the tool as a BaseTool subclass with config.type: native"),
    ("tools:" + entry("rlsp.agent.tools.calculator.CalculatorTool", "t", "{type: sandbox}"),
     "tools[0]: config.type 'sandbox' is not legal; legal: native"),
    ("tools:" + entry("rlsp.agent.tools.calculator.CalculatorTool", "t", "{max_digits: -1}"),
     "tools[0]: constructing 'rlsp.agent.tools.calculator.CalculatorTool' raised ValueError: CalculatorTool "
     "config max_digits=-1: must be an integer from 1 to 4300"),
    ("tools:\n  - {class_name: rlsp.agent.tools.calculator.CalculatorTool, tool_schema: {type: func}}",
     "tools[0]: constructing 'rlsp.agent.tools.calculator.CalculatorTool' raised ValueError: tool_schema.type "
     "must be 'function' (the only legal value), got 'func' in {'type': 'func'}"),
])
def test_yaml_errors(tmp_path: Path, body: str, error: str | None) -> None:
    path = write_yaml(tmp_path, body)
    with pytest.raises(ValueError) as err:
        load_tool_config(path)
    prefix = f"{TOOL_CONFIG_KEY}={path}: "
    assert str(err.value).startswith(prefix + "not valid YAML: ") if error is None else str(err.value) == prefix + error


def test_yaml_file_and_class_errors(tmp_path: Path) -> None:
    (tmp_path / "user_tools.py").write_text(USER_TOOL)
    user_module = import_file(str(tmp_path / "user_tools.py"), "test")
    missing = str(tmp_path / "none.yaml")
    with pytest.raises(ValueError) as err:
        load_tool_config(missing)
    assert str(err.value) == f"{TOOL_CONFIG_KEY}={missing}: file not found"
    for cls, error in [("BrokenTool", "constructing '{name}' raised RuntimeError: boom"),
                       ("NotATool", "'{name}' is not a subclass of rlsp.agent.tools.base.BaseTool (got "
                                    f"{user_module.NotATool!r}); tool classes must derive from BaseTool"),
                       ("Missing", f"{user_module.__name__!r} has no class 'Missing' (class_name '{{name}}')")]:
        name = f"{tmp_path}/user_tools.py:{cls}"
        path = write_yaml(tmp_path, "tools:" + entry(name, "t"))
        with pytest.raises(ValueError) as err:
            load_tool_config(path)
        assert str(err.value) == f"{TOOL_CONFIG_KEY}={path}: tools[0]: " + error.format(name=name)


FUNCTIONS = '''
import asyncio
import json
import threading
from json import dumps  # imported, so not a tool


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


async def shout(text: str, times: int = 1) -> str:
    """Repeat a text in upper case.

    Args:
        text: What to repeat.
        times: How many times.
    """
    await asyncio.sleep(0)
    return text.upper() * times


def where(values: list[float]) -> dict:
    """Sum numbers and say which thread ran.

    Args:
        values: The numbers.
    """
    return {"sum": sum(values), "thread": threading.current_thread().name}


def _helper() -> None:
    pass
'''


def test_function_tools(tmp_path: Path) -> None:
    path = tmp_path / "fns.py"
    path.write_text(FUNCTIONS)
    tools = load_tools(None, str(path))
    assert list(tools) == ["add", "shout", "where"] and all(type(t) is FunctionTool for t in tools.values())
    param = {"type": "integer", "description": "The first addend."}
    assert tool_schemas(tools)[0] == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.", "return": {"type": "integer"},
        "parameters": {"type": "object", "properties": {"a": param, "b": {"type": "integer",
                                                                          "description": "The second addend."}},
                       "required": ["a", "b"]}}}
    assert tools["shout"].get_openai_tool_schema()["function"]["parameters"] == {
        "type": "object", "required": ["text"], "properties": {
            "text": {"type": "string", "description": "What to repeat."},
            "times": {"type": "integer", "description": "How many times."}}}
    assert asyncio.run(tools["add"].execute("i", {"a": 2, "b": 3})) == (ToolResponse(text="5"), 0.0, {})
    assert asyncio.run(tools["shout"].execute("i", {"text": "hi", "times": 2}))[0].text == "HIHI"
    out = json.loads(asyncio.run(tools["where"].execute("i", {"values": [1.5, 2]}))[0].text)
    assert out["sum"] == 3.5 and out["thread"].startswith("asyncio_")  # sync functions run off the loop


def test_function_tool_errors(tmp_path: Path) -> None:
    bad, empty, missing = tmp_path / "bad.py", tmp_path / "empty.py", str(tmp_path / "none.py")
    bad.write_text("def f(x: int) -> int:\n    return x\n")
    empty.write_text("from os.path import join\n\ndef _private() -> None:\n    pass\n")
    for path, error in [(str(bad), f"cannot derive a tool schema for function 'f' in {bad}: Cannot generate JSON "
                         "schema for f because it has no docstring! (a function tool needs type hints on every "
                         "parameter and a Google-style docstring with a description and an 'Args:' entry per "
                         "parameter)"),
                        (str(empty), "the file defines no public functions (names not starting with '_') to use "
                         "as tools"),
                        (missing, f"file not found: {missing!r}")]:
        with pytest.raises(ValueError) as err:
            load_function_tools(path)
        assert str(err.value) == f"{FUNCTION_TOOL_KEY}={path}: {error}"


def test_duplicate_names_and_order(tmp_path: Path) -> None:
    fns = tmp_path / "fns.py"
    fns.write_text(FUNCTIONS)
    calc_entry = entry("rlsp.agent.tools.calculator.CalculatorTool", "add")
    yaml_path = write_yaml(tmp_path, "tools:" + calc_entry.replace("name: add", "name: calculator") + calc_entry)
    assert [t["function"]["name"] for t in tool_schemas(load_tools(yaml_path, None))] == ["calculator", "add"]
    assert load_tools(None, None) == {}
    with pytest.raises(ValueError) as err:
        load_tools(yaml_path, str(fns))
    source = f"{FUNCTION_TOOL_KEY}={fns}"
    assert str(err.value) == (f"{source}: tool name 'add' is defined twice: by {TOOL_CONFIG_KEY}={yaml_path} and by "
                              f"{source}; tool names must be unique")


def test_base_tool_schema_and_instances() -> None:
    with pytest.raises(ValueError) as err:
        BaseTool({}, {"type": "function", "function": {"description": "x"}})
    assert str(err.value) == "tool_schema.function.name must be a non-empty string, got None"
    tool = BaseTool({"k": 1}, CALCULATOR_SCHEMA)
    first, response = asyncio.run(tool.create(ground_truth="7"))
    second, _ = asyncio.run(tool.create("fixed"))
    assert (len(first), response, second, tool.state(first), tool.state("fixed")) == (
        36, ToolResponse(text=""), "fixed", {"ground_truth": "7"}, {})
    assert asyncio.run(tool.calc_reward(first)) == 0.0
    asyncio.run(tool.release(first))
    with pytest.raises(RuntimeError) as err:
        tool.state(first)
    assert str(err.value) == f"tool 'calculator' has no live instance {first!r}; live instances: ['fixed']"


class SleepTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        await asyncio.sleep(parameters["s"])
        return f"slept {parameters['s']}", 0.25, {"slept": parameters["s"], "note": "dropped"}


class CounterTool(BaseTool):
    """Counts its calls per trajectory and records every create, execute and release."""

    log: list[tuple[str, str, dict[str, Any]]]

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id, response = await super().create(instance_id, **kwargs)
        self.state(instance_id)["n"] = 0
        self.log.append(("create", instance_id, kwargs))
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        self.state(instance_id)["n"] += 1
        self.log.append(("execute", instance_id, kwargs))
        if parameters.get("fail"):
            raise RuntimeError("kaput")
        return ToolResponse(text=str(self.state(instance_id)["n"]) + parameters.get("pad", "")), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.5 * self.state(instance_id)["n"]  # asked once, before release

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.log.append(("release", instance_id, kwargs))
        await super().release(instance_id)
        if self.config.get("fail_release"):
            raise RuntimeError("cannot release")


def session(tools_kwargs: dict[str, dict] | None = None, counter_config: dict[str, Any] | None = None,
            **options: Any) -> tuple[ToolSession, CounterTool]:
    counter = CounterTool(counter_config or {}, schema("counter"))
    counter.log = []
    tools = {"calculator": CalculatorTool(), "counter": counter, "sleep": SleepTool({}, schema("sleep"))}
    settings = {"timeout_s": 2.0, "max_response_chars": 100, "truncate_side": "right", "max_parallel_calls": 4}
    return ToolSession(tools, tools_kwargs, **(settings | options)), counter


def test_truncate_text() -> None:
    text = "abcdefghijklmnopqrstuvwxyz0123456789"  # 36 characters; the marker is 17
    # verl's sides: "left" keeps the left part (the start), "right" the right part (the end)
    assert truncate_text(text, 27, "left") == ("abcdefghij...(truncated)...", True)
    assert truncate_text(text, 27, "right") == ("...(truncated)...0123456789", True)
    assert truncate_text(text, 27, "middle") == ("abcde...(truncated)...56789", True)
    assert truncate_text(text, 30, "middle") == ("abcdefg...(truncated)...456789", True)
    assert [truncate_text(text, 5, side) for side in ("left", "right", "middle")] == [
        ("abcde", True), ("56789", True), ("abc89", True)]  # no room for the marker
    assert truncate_text(text, 36, "middle") == (text, False)
    for limit, side, error in [(10, "top", "truncate side 'top' is not legal; legal sides: left, middle, right"),
                               (0, "left", "truncate limit 0 must be a positive number of characters")]:
        with pytest.raises(ValueError) as err:
            truncate_text(text, limit, side)
        assert str(err.value) == error


def test_session_runs_calls_concurrently_with_rewards_and_metrics() -> None:
    tools, _ = session()
    start = time.perf_counter()
    results = asyncio.run(tools.call([ToolCall("sleep", {"s": 0.3}), ToolCall("sleep", {"s": 0.3}),
                                      ToolCall("calculator", {"expression": "6 * 7"})]))
    # one after the other the two sleeps take at least 0.6 s: less shows they overlapped, however busy the machine
    assert time.perf_counter() - start < 0.6
    assert [(r.name, r.text, r.reward, r.metrics, r.error, r.truncated) for r in results] == [
        ("sleep", "slept 0.3", 0.25, {"slept": 0.3}, None, False)] * 2 + [
        ("calculator", "42", 0.0, {"calculator/error": 0.0}, None, False)]
    assert all(r.latency_s >= 0.3 for r in results[:2])


def test_session_faults_become_observations() -> None:
    tools, counter = session(max_parallel_calls=5, timeout_s=0.2)
    calls = [ToolCall("foo", {}), ToolCall("calculator", None, "invalid JSON: Expecting value"),
             ToolCall("counter", {"fail": True}), ToolCall("sleep", {"s": 5}), ToolCall("counter", {}),
             ToolCall("calculator", {"expression": "1"})]
    start = time.perf_counter()
    results = asyncio.run(tools.call(calls))
    assert time.perf_counter() - start < 5.0  # the 5 s sleep was cut off at its 0.2 s timeout, busy machine or not
    assert [(r.error, r.text) for r in results] == [
        ("unknown_tool", "Error: unknown tool 'foo'; available: calculator, counter, sleep"),
        ("bad_arguments", "Error: the call to 'calculator' could not be used: invalid JSON: Expecting value"),
        ("raised", "Error: tool 'counter' failed: RuntimeError: kaput"),
        ("timeout", "Error: tool 'sleep' timed out after 0.2 s"),
        (None, "2"),  # the failed call above still counted in the same instance
        ("too_many_calls", "Error: too many tool calls in one turn (6); at most 5 run per turn, so this call "
                           "was not run")]
    counts = tools.counts
    assert counts == {"calls": 6, "truncated": 0, "latency_s": sum(r.latency_s for r in results),
                      "release_errors": 0, "errors/unknown_tool": 1, "errors/bad_arguments": 1, "errors/raised": 1,
                      "errors/timeout": 1, "errors/too_many_calls": 1}
    assert [kind for kind, _, _ in counter.log] == ["create", "execute", "execute"]


def test_session_keeps_state_passes_kwargs_and_releases_once() -> None:
    kwargs = {"counter": {"create_kwargs": {"ground_truth": "42"}, "execute_kwargs": {"mode": "strict"}}}
    tools, counter = session(kwargs)

    async def trajectory() -> list[str]:
        texts = [r.text for r in await tools.call([ToolCall("counter", {})])]
        texts += [r.text for r in await tools.call([ToolCall("counter", {}), ToolCall("counter", {})])]
        await tools.close()
        await tools.close()  # a second close releases nothing again
        return texts

    assert sorted(asyncio.run(trajectory())) == ["1", "2", "3"]
    instance = counter.log[0][1]
    assert counter.log == [("create", instance, {"ground_truth": "42"})] + [
        ("execute", instance, {"mode": "strict"})] * 3 + [("release", instance, {})]
    assert counter._instances == {}
    # A new trajectory over the same tool objects starts from its own instance.
    fresh = ToolSession(tools.tools, None, timeout_s=2.0, max_response_chars=100, truncate_side="right",
                        max_parallel_calls=4)
    assert asyncio.run(fresh.call([ToolCall("counter", {})]))[0].text == "1"


async def call_and_close(tools: ToolSession, calls: list[ToolCall]) -> list[ToolResult]:
    results = await tools.call(calls)
    await tools.close()
    return results


def test_session_truncates_and_counts_release_errors() -> None:
    for side, text in [("left", "1xxxxxxxxx...(truncated)..."), ("right", "...(truncated)...xxxxxxxxxy"),
                       ("middle", "1xxxx...(truncated)...xxxxy")]:
        tools, _ = session(counter_config={"fail_release": True}, max_response_chars=27, truncate_side=side)
        (result,) = asyncio.run(call_and_close(tools, [ToolCall("counter", {"pad": "x" * 40 + "y"})]))
        assert (result.text, result.truncated, tools.counts["truncated"], tools.counts["release_errors"]) == (
            text, True, 1, 1)


def test_session_config_errors() -> None:
    for options, error in [({"timeout_s": 0}, "tool timeout_s=0 must be a positive number of seconds"),
                           ({"max_parallel_calls": 0}, "max_parallel_calls=0 must be an integer >= 1"),
                           ({"truncate_side": "up"}, "truncate side 'up' is not legal; legal sides: left, middle, "
                                                     "right"),
                           ({"tools_kwargs": {"counter": {"create_kwargs": [1]}}},
                            "tools_kwargs['counter']['create_kwargs'] must be a mapping of keyword arguments, got [1]")]:
        with pytest.raises(ValueError) as err:
            session(**options)
        assert str(err.value) == error


def test_final_rewards_tool_metrics_and_unnamed_malformed_calls() -> None:
    tools, counter = session()

    async def run() -> tuple[list[ToolResult], float]:
        results = await tools.call([ToolCall("counter", {}), ToolCall("sleep", {"s": 0.01}),
                                    ToolCall("", None, error="invalid JSON: Expecting value")])
        results += await tools.call([ToolCall("counter", {})])
        return results, await tools.close()

    results, final = asyncio.run(run())
    assert final == 0.5 * 2  # the counter instance's calc_reward after its two calls; sleep's default 0.0
    assert (results[2].error, results[2].text) == ("bad_arguments",
                                                   "Error: the tool call could not be used: invalid JSON: Expecting value")
    assert tools.counts["metrics/slept"] == 0.01 and "metrics/note" not in tools.counts  # numbers only
    assert [entry[0] for entry in counter.log] == ["create", "execute", "execute", "release"]
