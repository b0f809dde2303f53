"""Addition worked a digit at a time, for the curriculum bench (bench/curriculum_bench.py --worked):
the form its demonstrations write (`worked`; a difference's, `worked_difference`, for reasoning-gym's
chain_sum in bench/grow_bench.py --form worked), where an answer in that form first goes wrong
(`first_miss`), and a label check that accepts only a right working (`working`):

    label: {kind: verifier, check: {kind: python, function: "examples/addition/worked.py:working"}}

The task's own check (data.check) reads the last number alone, so a working that slips and still
ends on the right sum is right by it; `working` scores such an answer 0. As the label's check it
decides what RFT keeps, while held-out accuracy still reads the last number.

    python examples/addition/worked.py 458 867             # the working of 458 + 867, as the demonstrations write it
    python examples/addition/worked.py 458 867 --compact   # the short form (`compact`): a step a digit

Two forms. `worked` copies what is left of both numbers into every line, so each step reads its
digits at the end of the line before it: easy to follow, but its length grows with the square of
the digits (355 tokens at 8 digits). `compact` writes one short step a digit, reading each digit
pair from the prompt, then reads the sum back from its steps: length linear in the digits.
"""

from __future__ import annotations

import argparse
import re
import sys

def worked(a: int, b: int) -> str:
    """a + b worked a digit at a time from the right; its last number is the sum. Each step's inputs
    sit at the end of the line before it (the digits left, the carry), each line says what is left,
    so no step needs to count digits, and the carry is added apart (`+1`), where three digits at once
    were the model's most frequent slip:

    45 + 87, carry 0
    5+7=12, +0=12, carry 1, so far 2, left 4 + 8
    4+8=12, +1=13, carry 1, so far 32, left none
    the carry: so far 132
    So 45 + 87 = 132."""
    x_s, y_s, carry, done, lines = str(a), str(b), 0, "", [f"{a} + {b}, carry 0"]
    while x_s or y_s:
        x, y = int(x_s[-1]) if x_s else 0, int(y_s[-1]) if y_s else 0
        total = x + y + carry
        done, carry_in, carry = str(total % 10) + done, carry, total // 10
        x_s, y_s = x_s[:-1], y_s[:-1]
        left = f"{x_s or 0} + {y_s or 0}" if x_s or y_s else "none"
        lines.append(f"{x}+{y}={x + y}, +{carry_in}={total}, carry {carry}, so far {done}, left {left}")
    if carry:
        done = "1" + done
        lines.append(f"the carry: so far {done}")
    return "\n".join(lines) + f"\nSo {a} + {b} = {done}."


def worked_difference(a: int, b: int) -> str:
    """a - b worked as `worked` works a sum, a digit at a time from the right, the borrow taken apart
    (`-1`) and a negative digit made good (`+10`, borrow 1). Where b is the larger, the first line
    says so and b - a is worked, the sign put in front at the end; leading zeros of the difference
    are dropped on a line of their own. Its last number is the difference:

    478 - 718: 718 is larger, so work 718 - 478
    718 - 478, borrow 0
    8-8=0, -0=0, borrow 0, so far 0, left 71 - 47
    1-7=-6, -0=-6, +10=4, borrow 1, so far 40, left 7 - 4
    7-4=3, -1=2, borrow 0, so far 240, left none
    So 478 - 718 = -240."""
    lines, x, y = [], a, b
    if b > a:
        lines.append(f"{a} - {b}: {b} is larger, so work {b} - {a}")
        x, y = b, a
    x_s, y_s, borrow, done = str(x), str(y), 0, ""
    lines.append(f"{x} - {y}, borrow 0")
    while x_s or y_s:
        dx, dy = int(x_s[-1]) if x_s else 0, int(y_s[-1]) if y_s else 0
        total, borrow_in = dx - dy - borrow, borrow
        step = f"{dx}-{dy}={dx - dy}, -{borrow_in}={total}"
        borrow = int(total < 0)
        if borrow:
            total += 10
            step += f", +10={total}"
        done = str(total) + done
        x_s, y_s = x_s[:-1], y_s[:-1]
        left = f"{x_s or 0} - {y_s or 0}" if x_s or y_s else "none"
        lines.append(f"{step}, borrow {borrow}, so far {done}, left {left}")
    if len(done) > 1 and done.startswith("0"):
        done = done.lstrip("0") or "0"
        lines.append(f"without the leading zeros: {done}")
    return "\n".join(lines) + f"\nSo {a} - {b} = {'-' if b > a else ''}{done}."


def worked_expression(expression: str) -> str:
    """The working of "a + b" (`worked`) or "a - b" (`worked_difference`), as reasoning-gym's chain_sum
    writes its two-term problems in an entry's metadata."""
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(\d+)\s*", expression)
    if not m:
        raise ValueError(f"not a two-term sum or difference of whole numbers: {expression!r}")
    a, op, b = int(m[1]), m[2], int(m[3])
    return worked(a, b) if op == "+" else worked_difference(a, b)


def compact(a: int, b: int) -> str:
    """a + b a digit at a time from the right, the carry added in the step it goes into, then the sum
    read back from the steps: the last step's sum, then each earlier step's last digit:

    5+7=12 4+8+1=13 so 132"""
    x_s, y_s, carry, steps, sums = str(a), str(b), 0, [], []
    while x_s or y_s:
        x, y = int(x_s[-1]) if x_s else 0, int(y_s[-1]) if y_s else 0
        total = x + y + carry
        steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
        sums.append(total)
        carry, x_s, y_s = total // 10, x_s[:-1], y_s[:-1]
    return " ".join(steps) + " so " + str(sums[-1]) + "".join(str(t % 10) for t in reversed(sums[:-1]))


def indexed(a: int, b: int, first: int = 1) -> str:
    """a + b with every digit given its place, so that each step finds its digits by their tag, never
    by counting: each number's digits tagged from the left (d@ii, two digits a tag, so that a
    place past 9 looks like the rest), then a step a place from the last (`ii: x+y+carry=sum`),
    then the sum read from the steps (the last carry, then each step's last digit, from place 1 on):

    a 4@01 5@02 b 8@01 7@02 02: 5+7=12 01: 4+8+1=13 so 132

    `first`: the first place's tag (`shifted` starts each sum's tags elsewhere)."""
    x, y = str(a), str(b)
    n = max(len(x), len(y))
    x, y = x.rjust(n, "0"), y.rjust(n, "0")
    at = lambda i: f"{first + i - 1:02d}"  # noqa: E731 - place i's tag
    tags = lambda s: " ".join(f"{d}@{at(i)}" for i, d in enumerate(s, 1))  # noqa: E731
    steps, carry, digits = [], 0, {}
    for i in range(n, 0, -1):
        total = int(x[i - 1]) + int(y[i - 1]) + carry
        steps.append(f"{at(i)}: {x[i - 1]}+{y[i - 1]}" + (f"+{carry}" if carry else "") + f"={total}")
        digits[i], carry = total % 10, total // 10
    return (f"a {tags(x)} b {tags(y)} " + " ".join(steps) + " so " + ("1" if carry else "")
            + "".join(str(digits[i]) for i in range(1, n + 1)))


def shifted(a: int, b: int) -> str:
    """`indexed`, its tags starting at a place of their own (10 to 60, fixed by the sum), so that no tag
    says how long a number is: a model taught on 8 digits has seen tags up to 67, and a ninth digit
    is one more tag, not the first 09 it ever wrote (randomized positions, as for length
    generalization elsewhere)."""
    import hashlib

    return indexed(a, b, first=10 + int(hashlib.sha256(f"{a}+{b}".encode()).hexdigest(), 16) % 51)


def copy(x: int, form) -> tuple[str, str]:
    """A demonstration of the copy alone, in `form` (indexed or shifted): the prompt and the answer that
    writes x's digits with their places, as the form's working begins, then reads them back. No sum is
    in it, so it labels no level: it shows the model numbers longer than its sums, whose length a model
    taught on 8-digit sums alone cannot copy (docs/results.md, "Growing past the labels").

    Write the digits of 4567 with their places.  ->  a 4@01 5@02 6@03 7@04 so 4567"""
    head = form(x, 0).split(" b ")[0] if form is indexed else shifted_copy(x)
    return f"Write the digits of {x} with their places.", f"{head} so {x}"


def shifted_copy(x: int) -> str:
    import hashlib

    first = 10 + int(hashlib.sha256(f"copy {x}".encode()).hexdigest(), 16) % 51
    return indexed(x, 0, first=first).split(" b ")[0]


STEP = re.compile(r"(\d)\+(\d)=(\d+), \+(\d)=(\d+), carry (\d), so far (\d+), left (.*)$")


def first_miss(a: int, b: int, text: str, right: bool) -> str:
    """Where an answer worked as `worked` does first goes wrong, replayed a line at a time: the digits
    it adds (`wrong digits`), their sum, the carry it brings in, the sum with it, the carry out, the
    answer so far, the digits left (`left: copy`, or `left: stopped early`), a line of another form,
    or (every line right) the last lines."""
    if right:
        return "right"
    x_s, y_s, carry, done = str(a), str(b), 0, ""
    for line in text.split("\n")[1:]:
        if not x_s and not y_s:
            break
        m = STEP.match(line.strip())
        if not m:
            return "form"
        x, y = int(x_s[-1]) if x_s else 0, int(y_s[-1]) if y_s else 0
        total = x + y + carry
        done = str(total % 10) + done
        x_s, y_s = x_s[:-1], y_s[:-1]
        left = f"{x_s or 0} + {y_s or 0}" if x_s or y_s else "none"
        for kind, said, want in (("wrong digits", (m[1], m[2]), (str(x), str(y))), ("digit sum", m[3], str(x + y)),
                                 ("carry in", m[4], str(carry)), ("adding the carry", m[5], str(total)),
                                 ("carry out", m[6], str(total // 10)), ("so far", m[7], done)):
            if said != want:
                return kind
        if m[8] != left:
            return "left: stopped early" if m[8] == "none" else "left: copy"
        carry = total // 10
    return "the last lines" if not x_s and not y_s else "form"


TAGGED = re.compile(r"\s*a ((?:\d@\d+ ?)+)b ((?:\d@\d+ ?)+)(.*?) so (\d+)", re.S)


def first_miss_tagged(a: int, b: int, text: str) -> str:
    """Where an answer in the indexed or shifted form first goes wrong: the copy of a or of b (with how
    many digits it wrote), the tags, the number of steps, the first wrong step, the read-back, or
    "right". The text is model output: it is only matched and compared."""
    m = TAGGED.match(text)
    if not m:
        return "form"
    xa, xb = re.findall(r"(\d)@(\d+)", m[1]), re.findall(r"(\d)@(\d+)", m[2])
    n = max(len(str(a)), len(str(b)))
    x, y = str(a).rjust(n, "0"), str(b).rjust(n, "0")
    for name, got, want in (("a", xa, x), ("b", xb, y)):
        if "".join(d for d, _ in got) != want:
            return f"copy of {name}: {len(got)} of {n} digits" if len(got) != n else f"copy of {name}: digits"
    tags = [int(t) for _, t in xa]
    if tags != list(range(tags[0], tags[0] + n)) or [int(t) for _, t in xb] != tags:
        return "tags"
    steps = re.findall(r"(\d+): (\d)\+(\d)(?:\+(\d))?=(\d+)", m[3])
    if len(steps) != n:
        return f"steps: {len(steps)} of {n}"
    carry = 0
    for k, i in enumerate(range(n, 0, -1), 1):
        total = int(x[i - 1]) + int(y[i - 1]) + carry
        if steps[k - 1] != (f"{tags[i - 1]:02d}", x[i - 1], y[i - 1], str(carry) if carry else "", str(total)):
            return f"step {k}"
        carry = total // 10
    return "right" if m[4] == str(a + b) else "read-back"


PROMPT = re.compile(r"(\d+) \+ (\d+)\?\s*$")


def working(completion: str, answer: str | None = None, prompt: str | None = None, **fields) -> float | None:
    """1.0 when the answer is `worked`'s working of the prompt's sum, line for line, else 0.0; None
    (unscored) for a prompt that is not "... a + b?". The answer is model text: it is only compared."""
    m = PROMPT.search(prompt or "")
    if m is None:
        return None
    return float(completion.strip() == worked(int(m[1]), int(m[2])))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the working of a + b, as the worked demonstrations write it.")
    ap.add_argument("a", type=int)
    ap.add_argument("b", type=int)
    ap.add_argument("--compact", action="store_true", help="the short form: a step a digit")
    ap.add_argument("--indexed", action="store_true", help="every digit tagged with its place, a step a place")
    ap.add_argument("--shifted", action="store_true", help="--indexed, the tags starting at a place of their own")
    a = ap.parse_args(argv)
    form = compact if a.compact else indexed if a.indexed else shifted if a.shifted else worked
    print(form(a.a, a.b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
