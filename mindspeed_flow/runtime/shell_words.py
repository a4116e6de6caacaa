"""Just enough bash to read a MindSpeed-MM launch script: statements, assignments, and their values.

A launch script in the shape of MindSpeed-MM's examples is a list of variable assignments (literals, `$((...))`
arithmetic, `${VAR:-default}`, multi-line double-quoted flag strings with `\\` continuations) and one torchrun
command. `statements` groups physical lines into statements (a statement goes on while a quote, `$(`, `${` or
backtick is open, or while a line ends in a backslash); `Expander` evaluates the values as bash would for the
parts that need no command to run (`$(cmd)` and backticks are unknown: `UNKNOWN` in the result).
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass

UNKNOWN = "\x00"  # stands for text only a command (or an unset `${X:?}`) would give
NAME = r"[A-Za-z_][A-Za-z0-9_]*"
ASSIGNMENT = re.compile(rf"^(?P<indent>\s*)(?P<export>export\s+)?(?P<name>{NAME})=(?P<value>.*)$", re.S)
ENV_DEFAULT = re.compile(rf"\$\{{(?P<name>{NAME})(?P<op>:?[-=?])")


@dataclass(frozen=True)
class Statement:
    start: int  # first physical line (0-based)
    end: int  # one past the last physical line
    text: str  # the physical lines joined with "\n", comments left in

    @property
    def assignment(self) -> tuple[str, str] | None:
        """(name, raw value) when the statement is one `NAME=value` (optionally exported), else None."""
        m = ASSIGNMENT.match(strip_comment(self.text))
        if not m or len(split_words(m.group("value"))) > 1:
            return None
        return m.group("name"), m.group("value").strip()


def _scan(text: str):
    """Yield (index, char, depth) over `text`: depth = quotes and expansions open at the char (-1: a comment)."""
    stack: list[str] = []
    i, n = 0, len(text)
    word_start = True
    while i < n:
        c = text[i]
        top = stack[-1] if stack else ""
        if top == "'":
            if c == "'":
                stack.pop()
            yield i, c, len(stack)
            i += 1
            continue
        if c == "\\" and top != "`":
            yield i, c, len(stack)
            if i + 1 < n:
                yield i + 1, text[i + 1], len(stack)
            i += 2
            word_start = False
            continue
        if top in ("", "(") and c == "#" and word_start:
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                yield k, text[k], -1  # comment
            i = j
            continue
        depth = len(stack)
        if top == '"':
            if c == '"':
                stack.pop()
        elif top == "`":
            if c == "`":
                stack.pop()
        elif top == "{" and c == "}":
            stack.pop()
        elif c == ")" and top == "(":
            stack.pop()
        elif c in "'\"" or (c == "`" and top != "{"):
            stack.append(c)
        elif c == "(" and top in ("(", ""):
            stack.append("(")
        if c == "$" and i + 1 < n and text[i + 1] in "({":
            stack.append(text[i + 1])
            yield i, c, depth
            yield i + 1, text[i + 1], depth
            i += 2
            word_start = False
            continue
        yield i, c, depth
        word_start = c in " \t\n;|&(" and top in ("", "(")
        i += 1


def strip_comment(text: str) -> str:
    return "".join(c for _, c, depth in _scan(text) if depth != -1).rstrip()


def statements(text: str) -> list[Statement]:
    """The script's statements (blank and comment-only lines are statements of their own)."""
    lines = text.split("\n")
    depth_at_newline = {i: depth for i, c, depth in _scan(text) if c == "\n"}
    out: list[Statement] = []
    start, offset = 0, 0
    for idx, line in enumerate(lines):
        offset += len(line)  # the index of this line's "\n"
        continued = depth_at_newline.get(offset, 0) > 0 or (_ends_in_backslash(line) and
                                                            not line.lstrip().startswith("#"))
        offset += 1
        if not continued or idx == len(lines) - 1:
            out.append(Statement(start, idx + 1, "\n".join(lines[start:idx + 1])))
            start = idx + 1
    return out


def _ends_in_backslash(line: str) -> bool:
    s = line.rstrip()
    return (len(s) - len(s.rstrip("\\"))) % 2 == 1


def split_words(text: str) -> list[str]:
    """The unexpanded words of a command, quotes kept (`|`, `2>&1` are words too; `\\<newline>` joins lines)."""
    words, cur = [], []
    for _, c, depth in _scan(text.replace("\\\n", "")):
        if depth == -1:
            continue
        if depth == 0 and c in " \t\n":
            if cur:
                words.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if cur:
        words.append("".join(cur))
    return words


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: lambda a, b: int(a / b),
        ast.FloorDiv: lambda a, b: int(a / b), ast.Mod: operator.mod, ast.Pow: operator.pow}


def _arith(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _arith(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not integer arithmetic")


class Expander:
    """Expands words as bash would, from `variables` (name -> value; values may hold UNKNOWN)."""

    def __init__(self, variables: dict[str, str] | None = None):
        self.vars = dict(variables or {})

    def assign(self, name: str, raw_value: str) -> str:
        value = self.word(raw_value)
        self.vars[name] = value
        return value

    def word(self, raw: str) -> str:
        return self._expand(raw, quoted=False)

    def _dquoted(self, body: str) -> str:
        return self._expand(body, quoted=True)

    def _expand(self, raw: str, quoted: bool) -> str:
        """Expand `raw` as an unquoted word, or (quoted) as the inside of double quotes."""
        out, i, n = [], 0, len(raw)
        while i < n:
            c = raw[i]
            if c == "\\" and (not quoted or raw[i + 1:i + 2] in '$`"\\\n'):
                out.append("" if raw[i + 1:i + 2] == "\n" else raw[i + 1:i + 2])
                i += 2
            elif c == "$":
                text, i = self._dollar(raw, i)
                out.append(text)
            elif c == "`":
                j = raw.find("`", i + 1)
                out.append(UNKNOWN)
                i = n if j < 0 else j + 1
            elif c == "'" and not quoted:
                j = raw.find("'", i + 1)
                j = n if j < 0 else j
                out.append(raw[i + 1:j])
                i = j + 1
            elif c == '"' and not quoted:
                j = _closing(raw, i)
                out.append(self._dquoted(raw[i + 1:j]))
                i = j + 1
            else:
                out.append(c)
                i += 1
        return "".join(out)

    def _dollar(self, raw: str, i: int) -> tuple[str, int]:
        """Expand the `$...` at raw[i]; return (text, index after it)."""
        if raw.startswith("$((", i):
            j = _matching(raw, i + 1)
            return self._arithmetic(raw[i + 3:j - 1]), j + 1
        if raw.startswith("$(", i):
            return UNKNOWN, _matching(raw, i + 1) + 1
        if raw.startswith("${", i):
            j = _matching(raw, i + 1, "{", "}")
            return self._braced(raw[i + 2:j]), j + 1
        m = re.compile(NAME).match(raw, i + 1)
        if m:
            return self.vars.get(m.group(0), ""), m.end()
        return "$", i + 1

    def _braced(self, body: str) -> str:
        m = re.match(rf"({NAME})(?:(:?)([-=?+])(.*))?$", body, re.S)
        if not m:
            return UNKNOWN
        name, colon, op, rest = m.groups()
        value = self.vars.get(name)
        unset = value is None or (colon == ":" and value == "")
        if op is None:
            return value or ""
        if op == "+":
            return "" if unset else self.word(rest)
        if not unset:
            return value  # type: ignore[return-value]
        if op == "?":
            return UNKNOWN
        default = self.word(rest)
        if op == "=":
            self.vars[name] = default
        return default

    def _arithmetic(self, expr: str) -> str:
        text = self._dquoted(expr)
        text = re.sub(NAME, lambda m: self.vars.get(m.group(0), "") or "0", text)
        if UNKNOWN in text:
            return UNKNOWN
        try:
            return str(_arith(ast.parse(text.strip(), mode="eval")))
        except (ValueError, SyntaxError, ZeroDivisionError):
            return UNKNOWN


def _closing(raw: str, i: int) -> int:
    """Index of the `"` closing the one at raw[i] (skipping escapes and nested expansions)."""
    for j, c, depth in _scan(raw[i:]):
        if j > 0 and c == '"' and depth == 1:
            return i + j
    return len(raw)


def _matching(raw: str, i: int, open_: str = "(", close: str = ")") -> int:
    """Index of the bracket closing the one at raw[i]."""
    depth = 0
    for j in range(i, len(raw)):
        if raw[j] == open_:
            depth += 1
        elif raw[j] == close:
            depth -= 1
            if depth == 0:
                return j
    return len(raw)


def known(value: str | None) -> bool:
    return value is not None and UNKNOWN not in value
