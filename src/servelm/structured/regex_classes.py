r"""A regex's \d and \w as ASCII classes, whichever grammar library enforces it.

ECMAScript regexes (what JSON Schema's `pattern` is), xgrammar (vLLM's default backend) and
llguidance's JSON Schema patterns read \d as [0-9] and \w as [0-9A-Za-z_]; llguidance's plain
regexes follow Rust's regex crate, where both are Unicode classes: `\d{3}-\d{4}` let a sampled
model write "🯱🯱🯱-" (U+1FBF1, a segmented digit one, four bytes: three tokens each), and the
same request asked of the two backends gave two languages. Rewriting the shorthands before
llguidance sees the pattern makes the backends agree. \s stays Unicode, as ECMAScript has it.
"""

from __future__ import annotations

ASCII_RANGES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_shorthands(pattern: str) -> str:
    r"""`pattern` with \d \D \w \W spelled as ASCII classes; everything else as written.
    Inside a class a positive shorthand becomes its ranges, a negated one a nested class
    ([\Da] → [[^0-9]a]: Rust's regex syntax, which llguidance parses, nests classes)."""
    out: list[str] = []
    depth = 0  # open character classes around the cursor
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            ranges = ASCII_RANGES.get(escaped.lower())
            if ranges is None:
                out.append(pattern[i : i + 2])  # any other escape (\\, \[, \p{...}'s head) as written
            elif escaped.isupper():
                out.append(f"[^{ranges}]")
            else:
                out.append(ranges if depth else f"[{ranges}]")
            i += 2
            continue
        out.append(char)
        i += 1
        if char == "[":
            depth += 1
            # A ']' first in a class ([]a] or [^]a]) is a literal, not its end.
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):
                out.append("]")
                i += 1
        elif char == "]" and depth:
            depth -= 1
    return "".join(out)
