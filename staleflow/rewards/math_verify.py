"""Rule-based verification of math answers: extract the final answer from a response, normalise
it, and compare it with the reference. Pure functions, no I/O.

Extraction, first match wins:
1. the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces are balanced), or ``\\boxed 5``;
2. the last ``#### 42`` line (GSM8K style);
3. the last "answer is X" / "answer: X" (also "The final answer is $X$. I hope it is correct.");
4. otherwise the last number in the text.

Normalisation: strips ``$``, ``\\(\\)``/``\\[\\]``, ``\\left``/``\\right``, LaTeX spacing,
``\\text{}``/``\\mathrm{}``/``\\mbox{}`` wrappers and trailing units, degrees (``^\\circ``),
percent signs, thousands separators ("1,234"), a leading "x =", and unifies ``\\dfrac`` /
``\\tfrac`` / ``\\frac12`` / ``a/b``. Two answers are equal when their normal forms are equal,
or both are numbers with the same exact value (0.5 == 1/2 == \\frac{1}{2}; a percent sign is
dropped, so 50\\% == 50), or both are tuples/lists whose items are pairwise equal.

A policy writes what it likes, so every step is linear in its input and bounded: braces are
matched in one pass, ``\\frac`` groups nested deeper than ``MAX_FRAC_NESTING`` are left as they
are, and a number with more than ``MAX_NUMBER_CHARS`` characters or an exponent beyond
``MAX_EXPONENT`` is not evaluated (``1e10000000`` would need 10,000,000 digits): it equals only
the same text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*(?:\$\s*)?([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad")
_SHORT_FRAC = re.compile(r"\\frac\s*(\d)\s*(\d)")
_SHORT_SQRT = re.compile(r"\\sqrt\s*(\d+|[a-z])")
_DECIMAL = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?$")
_SLASH_FRACTION = re.compile(r"^([+-]?\d+(?:\.\d+)?)/([+-]?\d+(?:\.\d+)?)$")
_LEADING_ASSIGNMENT = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(?=\S)")
_UNIT_SUFFIX = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?)\s+[a-zA-Z][a-zA-Z\s^{}\d]*$")
_DOLLARS = re.compile(r"\\?\$")
_BOXED_BARE_TOKEN = re.compile(r"[^\s$.,]+")
_EXPONENT = re.compile(r"e([+-]?\d+)$")

MAX_NUMBER_CHARS = 200
MAX_EXPONENT = 400
MAX_FRAC_NESTING = 64


def matching_braces(text: str) -> dict[int, int]:
    """The index of the ``}`` that closes each ``{`` of ``text`` (unclosed ones are absent), in one pass."""
    closes: dict[int, int] = {}
    opened: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            opened.append(i)
        elif ch == "}" and opened:
            closes[opened.pop()] = i
    return closes


def last_boxed(text: str) -> str | None:
    found = None
    closes: dict[int, int] | None = None
    for match in _BOXED.finditer(text):
        end = match.end()
        if end < len(text) and text[end] == "{":
            if closes is None:
                closes = matching_braces(text)
            close = closes.get(end)
            if close is not None:
                found = text[end + 1:close]
        elif end < len(text) and match.group(0).endswith(" "):  # \boxed 5
            token = _BOXED_BARE_TOKEN.match(text, end)
            if token:
                found = token.group(0)
    return found


def extract_answer(text: str) -> tuple[str | None, str]:
    """(answer, how it was found): one of boxed, gsm8k, answer_is, last_number, or (None, none)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    hashes = _GSM8K.findall(text)
    if hashes:
        return hashes[-1].strip(), "gsm8k"
    stated = _ANSWER_IS.findall(text)
    if stated:
        answer = re.split(r"\$|\.\s|\.$|\sI hope", stated[-1].strip())[0]
        if answer.strip():
            return answer.strip(), "answer_is"
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1], "last_number"
    return None, "none"


def _strip_frac_groups(s: str) -> str:
    """``\\frac{a}{b}`` -> ``(a)/(b)`` with nested groups converted too. One pass over ``s``; a
    ``\\frac`` without both groups ends the conversion there, and one nested deeper than
    ``MAX_FRAC_NESTING`` leaves ``s`` as it is."""
    if "\\frac{" not in s:
        return s
    closes = matching_braces(s)

    def convert(start: int, end: int, depth: int) -> str | None:
        if depth > MAX_FRAC_NESTING:
            return None
        out: list[str] = []
        position = start
        while True:
            i = s.find("\\frac{", position, end)
            if i < 0:
                break
            numerator_open = i + 5
            numerator_close = closes.get(numerator_open)
            denominator_open = (numerator_close or 0) + 1
            if numerator_close is None or denominator_open >= end or s[denominator_open] != "{":
                break
            denominator_close = closes.get(denominator_open)
            if denominator_close is None or denominator_close >= end:
                break
            numerator = convert(numerator_open + 1, numerator_close, depth + 1)
            denominator = convert(denominator_open + 1, denominator_close, depth + 1)
            if numerator is None or denominator is None:
                return None
            out += [s[position:i], f"{_atom(numerator)}/{_atom(denominator)}"]
            position = denominator_close + 1
        out.append(s[position:end])
        return "".join(out)

    converted = convert(0, len(s), 0)
    return s if converted is None else converted


def _atom(x: str) -> str:
    return x if re.fullmatch(r"[+-]?[\w.]+", x) else f"({x})"


def normalize(answer: str) -> str:
    """The canonical form of an answer; normalising it again changes nothing."""
    s = answer
    for _ in range(8):  # each pass can expose another rule's input ("((1))"): run to the fixpoint
        again = _normalize_once(s)
        if again == s:
            break
        s = again
    return s


def _normalize_once(answer: str) -> str:
    s = answer.strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in ("\\left", "\\right", "\\displaystyle", "\\(", "\\)", "\\[", "\\]"):
        s = s.replace(token, "")
    s = _SPACING.sub("", s)
    s = _DOLLARS.sub("", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _TEXT_WRAPPER.sub(r" \1", s)
    s = _SHORT_FRAC.sub(r"\\frac{\1}{\2}", s)
    s = _SHORT_SQRT.sub(r"\\sqrt{\1}", s)
    s = _strip_frac_groups(s)
    s = _THOUSANDS.sub("", s)
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)  # x^{2} -> x^2
    s = s.strip().rstrip(".").strip()
    s = _LEADING_ASSIGNMENT.sub("", s)
    unit = _UNIT_SUFFIX.match(s)
    if unit:
        s = unit.group(1)
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"\([+-]?[\w.]+\)", s):  # a lone parenthesised atom
        s = s[1:-1]
    return s


def parse_number(s: str) -> Fraction | None:
    """The exact value of a normalised answer that is a number or a simple fraction."""
    s = s.strip()
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1:
        s = s[1:-1]
    if len(s) > MAX_NUMBER_CHARS:
        return None
    exponent = _EXPONENT.search(s)
    if exponent and abs(int(exponent.group(1))) > MAX_EXPONENT:
        return None
    try:
        if _DECIMAL.match(s):
            return Fraction(s)
        fraction = _SLASH_FRACTION.match(s.replace("(", "").replace(")", ""))
        if fraction:
            numerator, denominator = Fraction(fraction.group(1)), Fraction(fraction.group(2))
            return numerator / denominator if denominator != 0 else None
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _split_top_level(s: str) -> tuple[str, list[str]] | None:
    """``(a,b)`` -> ("()", [a, b]); plain ``a,b`` -> ("", [a, b]); None if no top-level comma."""
    brackets = ""
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}":
        brackets, s = s[0] + s[-1], s[1:-1]
    parts, depth, current = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return (brackets, parts) if len(parts) > 1 else None


def normalized_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    split_a, split_b = _split_top_level(a), _split_top_level(b)
    if split_a and split_b and split_a[0] == split_b[0] and len(split_a[1]) == len(split_b[1]):
        return all(normalized_equal(p, q) for p, q in zip(split_a[1], split_b[1], strict=True))
    return False


def answers_equal(predicted: str, reference: str) -> bool:
    return normalized_equal(normalize(predicted), normalize(reference))


def verify_math(response_text: str, reference: str) -> tuple[float, str, str]:
    """(reward, reason, detail): 1.0 "correct", or 0.0 with "wrong_answer" / "no_answer"."""
    predicted, how = extract_answer(response_text)
    if predicted is None:
        return 0.0, "no_answer", "no boxed, '####', 'answer is' or number in the response"
    reference_answer = last_boxed(reference) or reference
    detail = f"{how}: {normalize(predicted)!r} vs {normalize(reference_answer)!r}"
    if answers_equal(predicted, reference_answer):
        return 1.0, "correct", detail
    return 0.0, "wrong_answer", detail
