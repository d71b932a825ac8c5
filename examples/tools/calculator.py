"""A calculator tool to copy: `--tools examples/tools/calculator.py`.

A tool is a plain function with a type hint on every argument and a Google-style docstring: the model
reads its name, the docstring's first paragraph and each argument's line (tools.load_tools turns them
into a JSON schema). It returns text, or a number, list or dict, which the model reads as JSON; what it
raises, the model reads as an error message.

The model writes the expression, so we parse it ourselves with `ast` and compute only numbers and
arithmetic (+ - * / // % **, parentheses, unary minus): never eval, no names, no calls, no attributes.
Numbers are kept small enough that no expression can take long: powers are bounded, and so are the
digits of every integer on the way.
"""

import ast
import math
import operator

MAX_LENGTH = 500  # characters of an expression
MAX_EXPONENT = 1000  # |b| in a ** b
MAX_DIGITS = 1000  # digits of any integer, the result's and every intermediate one's
MAX_DEPTH = 200  # nested operations (a sum of 200 numbers); far below Python's recursion limit
LIMIT = 10**MAX_DIGITS

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic to compute, e.g. "(3 + 4) * 12 / 5". Numbers, + - * / // % ** and parentheses.
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_LENGTH}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:  # ValueError: a literal of more than 4300 digits
        raise ValueError(f"not an arithmetic expression: {e}") from None
    try:
        return str(_evaluate(tree.body, 0))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None


def _evaluate(node, depth):
    if depth > MAX_DEPTH:
        raise ValueError(f"more than {MAX_DEPTH} nested operations")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not True, not 1j, not "1"
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(OPERATORS[type(node.op)](left, right))
    if isinstance(node, ast.BinOp):
        raise ValueError(f"operator {type(node.op).__name__} is not allowed; use {' '.join(SYMBOLS.values())}")
    raise ValueError(
        f"{ast.unparse(node)[:50]!r} is not allowed: only numbers, {' '.join(SYMBOLS.values())} and parentheses"
    )


def _check_power(base, exponent):
    """Refuse a ** b before computing it when b or the result would be too large."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent {exponent} is too large; at most {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > MAX_DIGITS:
            raise ValueError(f"the result would have more than {MAX_DIGITS} digits")


def _checked(value):
    """`value`, if it is a real number we allow."""
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and abs(value) >= LIMIT:
        raise ValueError(f"a number with more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):  # 1e308 * 10
        raise OverflowError
    return value
