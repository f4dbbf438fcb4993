"""The built-in arithmetic tool: `CalculatorTool` evaluates + - * / // % ** over numbers, exactly and bounded.

The expression is model text, so it is untrusted: it is parsed with `ast` and only a whitelist of number
and operator nodes is evaluated; nothing is ever passed to eval or exec. Every intermediate result is held
to `max_digits` digits, and a power is refused before it is computed when its estimated size exceeds that,
so an expression like 9**9**9 is answered at once instead of running out of time or memory.

In verl's tool YAML: `class_name: rlsp.agent.tools.calculator.CalculatorTool` with a schema like
`CALCULATOR_SCHEMA` (one string parameter, `expression`).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from rlsp.agent.tools.base import BaseTool, ToolResponse

CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression to evaluate, e.g. (3 + 4) * 12"},
            },
            "required": ["expression"],
        },
    },
}

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "numbers, + - * / // % ** and parentheses"
# Python refuses to print ints longer than this by default (sys.int_info.default_max_str_digits).
_MAX_PRINTABLE_DIGITS = 4300
# Every integer up to this size is exactly a float.
_FLOAT_EXACT = 2 ** 53


class CalculatorError(Exception):
    """An expression the calculator refuses or cannot evaluate; its message is shown to the model."""


def _positive_int(config: dict[str, Any], key: str, default: int, upper: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
        raise ValueError(f"CalculatorTool config {key}={value!r}: must be an integer from 1 to {upper}")
    return value


class _Evaluator:
    """Walks a parsed expression, allowing only number and arithmetic nodes, within a digit bound."""

    def __init__(self, max_digits: int) -> None:
        self.max_digits = max_digits
        self.limit = 10 ** max_digits

    def check(self, value: Any) -> int | float:
        # bool is an int subclass and complex comes from e.g. (-8) ** 0.5: neither is a calculator number.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalculatorError(f"the result {value!r} is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is too large (not a finite number)")
        if abs(value) >= self.limit:
            raise CalculatorError(f"the result has more than {self.max_digits} digits")
        return value

    def eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise CalculatorError(f"only numbers are allowed, found {node.value!r}; use only {_ALLOWED}")
            return self.check(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                self.check_power(left, right)
            try:
                return self.check(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("the result is too large") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.check(_UNARY[type(node.op)](self.eval(node.operand)))
        raise CalculatorError(_refusal(node))

    def check_power(self, base: int | float, exponent: int | float) -> None:
        """Refuse base ** exponent before computing it when its size would pass the digit bound."""
        if base == 0 or abs(base) == 1 or exponent == 0:
            return
        # The result has about exponent * log10|base| digits; a negative product means a result below 1.
        try:
            digits = exponent * math.log10(abs(base))
        except OverflowError:  # an exponent too large to be a float
            raise CalculatorError(f"the result has more than {self.max_digits} digits") from None
        self._refuse_if_large(digits)

    def _refuse_if_large(self, digits: float) -> None:
        # +1: the estimate may be a hair off for results right at the bound, which check() then settles.
        if digits > self.max_digits + 1:
            raise CalculatorError(f"the result has more than {self.max_digits} digits")


def _refusal(node: ast.AST) -> str:
    """Why a node is not evaluated, in words for the model."""
    if isinstance(node, ast.Name):
        return f"names are not allowed (found {node.id!r}); use only {_ALLOWED}"
    if isinstance(node, ast.Call):
        return f"function calls are not allowed; use only {_ALLOWED}"
    if isinstance(node, ast.Attribute):
        return f"attribute access is not allowed; use only {_ALLOWED}"
    if isinstance(node, ast.BinOp):
        return f"the operator {type(node.op).__name__} is not allowed; use only {_ALLOWED}"
    return f"{type(node).__name__} is not allowed; use only {_ALLOWED}"


def format_number(value: int | float) -> str:
    """An int as its exact digits; a float as an int when it is integral and exact, else Python's repr."""
    # Past 2**53 a float's integer digits are partly rounding noise, so those keep the float form (1e+20).
    if isinstance(value, float) and value.is_integer() and abs(value) <= _FLOAT_EXACT:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def evaluate(expression: str, max_digits: int = 100) -> str:
    """The value of a whitelisted arithmetic expression as text; raises CalculatorError to refuse it."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not a valid expression ({exc.msg})") from None
    except (ValueError, RecursionError, MemoryError):
        raise CalculatorError("not a valid expression") from None
    try:
        return format_number(_Evaluator(max_digits).eval(tree))
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


class CalculatorTool(BaseTool):
    """Arithmetic on integers (exact) and floats; errors come back as text starting with "Error:".

    Config: `max_expression_chars` (default 200), `max_digits` (default 100, the bound on every number
    and intermediate result), `reward_on_success` (default 0.0, the step reward when it evaluates).
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema if tool_schema is not None else CALCULATOR_SCHEMA)
        self.max_expression_chars = _positive_int(self.config, "max_expression_chars", 200, 100_000)
        self.max_digits = _positive_int(self.config, "max_digits", 100, _MAX_PRINTABLE_DIGITS)
        reward = self.config.get("reward_on_success", 0.0)
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(f"CalculatorTool config reward_on_success={reward!r}: must be a number")
        self.reward_on_success = float(reward)

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        """Evaluate `parameters["expression"]`; a refusal is an "Error: ..." response, never an exception."""
        try:
            text = evaluate(self._expression(parameters), self.max_digits)
        except CalculatorError as exc:
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"calculator/error": 1.0}
        return ToolResponse(text=text), self.reward_on_success, {"calculator/error": 0.0}

    def _expression(self, parameters: dict[str, Any]) -> str:
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        if not isinstance(expression, str):
            raise CalculatorError(f"the 'expression' parameter must be a string, got {expression!r}")
        if len(expression) > self.max_expression_chars:
            raise CalculatorError(f"the expression has {len(expression)} characters; "
                                  f"at most {self.max_expression_chars} are allowed")
        return expression
