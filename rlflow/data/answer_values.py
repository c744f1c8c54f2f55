"""Answers are values: when the reference is a number, the graded answer must be one too.

math-verify (Kydlicek et al., HF Math-Verify) parses an answer into a sympy object *without
evaluating it* (``parse("71 + 60")`` is the unevaluated ``Add(71, 60)``) and then decides
equivalence by simplifying both sides, so a completion that only restates the question
(``71 + 60, that's a easy one.``) "equals" the reference 131. A policy learns that in a few
dozen GRPO steps (issue 44: held-out ``math_verify`` accuracy 0.865, the last stated number
right in 0.355 of the answers). The rule here closes that hole:

**When the reference parses to a value, only parsed answers that are values count.** A
*value* is a number literal as written, read from math-verify's unevaluated sympy tree
(:func:`is_value`):

* a sympy ``Number``: an integer, a decimal or a LaTeX fraction / mixed number
  (``60``, ``-5``, ``60.0``, ``$60``, ``1,000``, ``\\frac{3}{4}``, ``3\\frac{1}{2}``);
* a plain fraction of two integer literals, optionally negated (``3/4``, ``-3/4``);
* a percentage of a number literal (``60%``, ``60\\%``): a value; math-verify's own
  equivalence then decides (it accepts ``60%`` for the reference ``60`` and ``75%`` for
  ``3/4``, as GSM8K references drop units);
* scientific notation (``6e1``, ``1.5e3``), which math-verify reads as ``6`` / ``1.5``, is
  rewritten to its decimal (``60``, ``1500``) before parsing (:func:`plain_numbers`).

Anything with an operation left in it is not a value and scores 0: ``27 + 33``, ``2*30``,
``1/2 + 1/4``, ``2^3``, ``\\sqrt{2}``. A chain ``27 + 33 = 60`` is graded by its last side
(math-verify takes the right-hand side of an equation), so it states the value 60. References
that are not values (``x + 1``, ``\\sqrt{2}``, an interval) keep math-verify's plain
equivalence.

Why the parsed tree and not the text: math-verify has already found the answer in the text
(boxed, ``####``, "final answer is", or the last expression) and dropped units, ``$``,
thousands separators and LaTeX spacing; checking its tree for operations needs no second
extractor that could disagree with it, and it sees LaTeX operators (``\\times``, ``\\cdot``,
``\\frac{a}{b}+c``) that a character scan would have to list.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# 6e1, 1.5E+3, 2.5e-3 as a whole token (not inside a word such as "x2e3")
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?[eE][-+]?\d+)(?![\w.])")


def plain_numbers(text: str) -> str:
    """``text`` with scientific-notation literals written as plain decimals (``6e1`` ->
    ``60``, ``2.5e-3`` -> ``0.0025``); math-verify would read ``6e1`` as 6."""
    def plain(m: re.Match) -> str:
        try:
            return format(Decimal(m.group(1)), "f")
        except InvalidOperation:    # pragma: no cover - the pattern admits only decimals
            return m.group(1)
    return _SCIENTIFIC.sub(plain, text)


def is_value(expr) -> bool:
    """Whether a math-verify parse result (an unevaluated sympy expression, or its string
    twin) is a value by the rule of the module docstring.

    Args:
      expr: one element of ``math_verify.parse(...)``'s list (sympy object or ``str``).

    Returns: True for a number literal, a fraction of integer literals (optionally negated)
    or a percentage of a number literal; False for strings, symbols, sets, relations and
    every expression with an operation left in it.
    """
    import sympy

    if isinstance(expr, sympy.Number):
        return True
    if not isinstance(expr, sympy.Mul):
        return False
    args = expr.args                  # -3/4 parses as (-1) * 3 * 4^-1, whose args are (-3, 4^-1)
    if len(args) != 2:
        return False
    numbers = [a for a in args if isinstance(a, sympy.Number)]
    rest = [a for a in args if not isinstance(a, sympy.Number)]
    if len(numbers) != 1 or len(rest) != 1:
        return False
    (number,), (other,) = numbers, rest
    if isinstance(other, sympy.UnevaluatedExpr):         # 60% parses as 60 * (1/100)
        return other.args[0] == sympy.Rational(1, 100)
    return (isinstance(number, sympy.Integer) and isinstance(other, sympy.Pow)
            and isinstance(other.base, sympy.Integer) and other.base > 0
            and other.exp == -1)                         # a/b parses as a * b^-1


def values(parsed) -> list:
    """The elements of a math-verify parse result that are values (:func:`is_value`)."""
    return [p for p in parsed if is_value(p)]
