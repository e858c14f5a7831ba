"""Write `toy_env/tasks.jsonl`: 48 single-bug tasks (40 train, 8 eval) in strop's task file format,
each a small module with a helper and one function whose expression is wrong, a visible test and
hidden tests. Families of bugs (a wrong operator, a wrong bound, a wrong index, a wrong method)
over different names, so that a policy warm-started on sessions of the train tasks meets new code
on the eval ones.

    python examples/toy_env/make_tasks.py
"""

import json
from pathlib import Path

# (module, function, parameters, right body, wrong body, [(call, expected)], what the task says)
BUGS = [
    (
        "mathx",
        "clamp",
        "x, lo, hi",
        "max(lo, min(x, hi))",
        "min(lo, max(x, hi))",
        [("clamp(5, 0, 3)", "3"), ("clamp(-1, 0, 3)", "0")],
        "does not keep x between lo and hi",
    ),
    ("geo", "area", "w, h", "w * h", "w + h", [("area(2, 3)", "6"), ("area(4, 4)", "16")], "should multiply the sides"),
    ("rects", "perimeter", "w, h", "2 * (w + h)", "2 * w + h", [("perimeter(2, 3)", "10")], "gets the perimeter wrong"),
    (
        "stats",
        "mean",
        "xs",
        "sum(xs) / len(xs)",
        "sum(xs) / (len(xs) + 1)",
        [("mean([2, 4])", "3")],
        "returns the wrong average",
    ),
    ("money", "cents", "x", "round(x * 100)", "round(x * 10)", [("cents(1.5)", "150")], "converts amounts wrongly"),
    (
        "temps",
        "c_to_f",
        "c",
        "c * 9 / 5 + 32",
        "c * 5 / 9 + 32",
        [("c_to_f(100)", "212"), ("c_to_f(0)", "32")],
        "converts Celsius wrongly",
    ),
    ("speed", "kmh", "ms", "ms * 3.6", "ms / 3.6", [("kmh(10)", "36.0")], "converts metres per second wrongly"),
    (
        "ages",
        "is_adult",
        "age",
        "age >= 18",
        "age > 18",
        [("is_adult(18)", "True"), ("is_adult(17)", "False")],
        "is wrong on the 18th birthday",
    ),
    ("votes", "can_vote", "age", "age >= 16", "age > 16", [("can_vote(16)", "True")], "is wrong at exactly 16"),
    (
        "grades",
        "passes",
        "score",
        "score >= 50",
        "score > 50",
        [("passes(50)", "True"), ("passes(49)", "False")],
        "fails a score of exactly 50",
    ),
    (
        "weather",
        "is_hot",
        "t",
        "t >= 30",
        "t <= 30",
        [("is_hot(35)", "True"), ("is_hot(10)", "False")],
        "has the comparison backwards",
    ),
    (
        "dates",
        "is_leap",
        "y",
        "y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)",
        "y % 4 == 0 and (y % 100 == 0 or y % 400 == 0)",
        [("is_leap(2024)", "True"), ("is_leap(1900)", "False")],
        "gets ordinary leap years wrong",
    ),
    ("lists", "last", "xs", "xs[-1]", "xs[0]", [("last([1, 2, 3])", "3")], "should return the last item"),
    ("queue", "front", "xs", "xs[0]", "xs[1]", [("front([7, 8, 9])", "7")], "should return the first item"),
    ("pairs", "second", "xs", "xs[1]", "xs[2]", [("second([4, 5, 6])", "5")], "should return the second item"),
    ("tails", "rest", "xs", "xs[1:]", "xs[2:]", [("rest([1, 2, 3])", "[2, 3]")], "should drop only the first item"),
    ("heads", "head", "xs, n", "xs[:n]", "xs[:n - 1]", [("head([1, 2, 3], 2)", "[1, 2]")], "returns one item too few"),
    ("totals", "total", "xs", "sum(xs)", "max(xs)", [("total([1, 2, 3])", "6")], "should add the numbers up"),
    ("peaks", "highest", "xs", "max(xs)", "min(xs)", [("highest([3, 9, 4])", "9")], "returns the lowest number"),
    ("lows", "lowest", "xs", "min(xs)", "max(xs)", [("lowest([3, 9, 4])", "3")], "returns the highest number"),
    ("counts", "size", "xs", "len(xs)", "len(xs) - 1", [("size([1, 2, 3])", "3")], "miscounts by one"),
    (
        "text",
        "shout",
        "s",
        's.upper() + "!"',
        's.lower() + "!"',
        [("shout('hi')", "'HI!'")],
        "should upper-case its text",
    ),
    ("quiet", "whisper", "s", "s.lower()", "s.upper()", [("whisper('Hi')", "'hi'")], "should lower-case its text"),
    ("trim", "clean", "s", "s.strip()", "s.lstrip()", [("clean(' a ')", "'a'")], "leaves trailing spaces"),
    (
        "words",
        "count_words",
        "s",
        "len(s.split())",
        'len(s.split(" "))',
        [("count_words('a  b')", "2")],
        "miscounts with extra spaces",
    ),
    (
        "names",
        "initials",
        "s",
        '"".join(w[0] for w in s.split())',
        '"".join(w[-1] for w in s.split())',
        [("initials('ada lovelace')", "'al'")],
        "should take each word's first letter",
    ),
    (
        "titles",
        "capitalize",
        "s",
        "s[:1].upper() + s[1:]",
        "s[:1].lower() + s[1:]",
        [("capitalize('hello')", "'Hello'")],
        "does not capitalize",
    ),
    (
        "paths",
        "extension",
        "name",
        'name.rsplit(".", 1)[-1]',
        'name.split(".", 1)[-1]',
        [("extension('a.tar.gz')", "'gz'")],
        "returns more than the last extension",
    ),
    (
        "seqs",
        "evens",
        "xs",
        "[x for x in xs if x % 2 == 0]",
        "[x for x in xs if x % 2 == 1]",
        [("evens([1, 2, 3, 4])", "[2, 4]")],
        "should keep the even numbers",
    ),
    (
        "odds",
        "odd_only",
        "xs",
        "[x for x in xs if x % 2 == 1]",
        "[x for x in xs if x % 2 == 0]",
        [("odd_only([1, 2, 3])", "[1, 3]")],
        "should keep the odd numbers",
    ),
    (
        "positives",
        "positive",
        "xs",
        "[x for x in xs if x > 0]",
        "[x for x in xs if x >= 0]",
        [("positive([-1, 0, 2])", "[2]")],
        "keeps zero",
    ),
    (
        "squares",
        "squares",
        "xs",
        "[x * x for x in xs]",
        "[x + x for x in xs]",
        [("squares([3])", "[9]")],
        "doubles instead of squaring",
    ),
    (
        "nums",
        "sign",
        "x",
        "(x > 0) - (x < 0)",
        "(x < 0) - (x > 0)",
        [("sign(5)", "1"), ("sign(-2)", "-1")],
        "returns the opposite sign",
    ),
    ("dist", "distance", "a, b", "abs(a - b)", "a - b", [("distance(2, 5)", "3")], "can be negative"),
    ("powers", "cube", "x", "x ** 3", "x ** 2", [("cube(2)", "8")], "squares instead of cubing"),
    ("halves", "half", "x", "x / 2", "x // 2", [("half(3)", "1.5")], "rounds down"),
    (
        "ratios",
        "percent",
        "part, whole",
        "100 * part / whole",
        "100 * whole / part",
        [("percent(1, 4)", "25.0")],
        "divides the wrong way",
    ),
    (
        "prices",
        "discounted",
        "price, rate",
        "price * (1 - rate)",
        "price * (1 + rate)",
        [("discounted(100, 0.25)", "75.0")],
        "adds the discount instead",
    ),
    (
        "taxes",
        "with_tax",
        "price, rate",
        "price * (1 + rate)",
        "price * rate",
        [("with_tax(100, 0.5)", "150.0")],
        "forgets the price itself",
    ),
    (
        "ranges",
        "span",
        "xs",
        "max(xs) - min(xs)",
        "max(xs) + min(xs)",
        [("span([2, 9])", "7")],
        "adds instead of subtracting",
    ),
    ("flags", "both", "a, b", "a and b", "a or b", [("both(True, False)", "False")], "is true when only one is"),
    ("gates", "either", "a, b", "a or b", "a and b", [("either(True, False)", "True")], "needs both to be true"),
    ("bits", "is_even", "n", "n % 2 == 0", "n % 2 == 1", [("is_even(4)", "True")], "has odd and even swapped"),
    (
        "steps",
        "next_multiple",
        "n, k",
        "(n // k + 1) * k",
        "(n // k) * k",
        [("next_multiple(7, 5)", "10")],
        "returns the previous multiple",
    ),
    (
        "files",
        "is_python",
        "name",
        'name.endswith(".py")',
        'name.startswith(".py")',
        [("is_python('a.py')", "True")],
        "checks the wrong end",
    ),
    (
        "emails",
        "domain",
        "addr",
        'addr.split("@")[1]',
        'addr.split("@")[0]',
        [("domain('a@b.org')", "'b.org'")],
        "returns the user, not the domain",
    ),
    (
        "lines",
        "line_count",
        "text",
        "len(text.splitlines())",
        'len(text.split(" "))',
        [("line_count('a\\nb c d')", "2")],
        "counts words instead of lines",
    ),
    ("keys", "has_key", "d, k", "k in d", "k not in d", [("has_key({'a': 1}, 'a')", "True")], "answers the opposite"),
]
HELPERS = [
    "def helper(x):\n    return x\n",
    "def describe(x):\n    return repr(x)\n",
    "def identity(x):\n    return x\n",
]


def task(i: int, bug: tuple) -> dict:
    mod, fn, params, right, wrong, cases, what = bug
    buggy, fixed = f"def {fn}({params}):\n    return {wrong}", f"def {fn}({params}):\n    return {right}"
    checks = "\n".join(f"    assert {call} == {want}" for call, want in cases)
    visible = f"{cases[0][0]} == {cases[0][1]}"  # the first hidden case, shown
    return {
        "instance_id": f"toy-{mod}",
        "problem_statement": f"`{fn}` in {mod}.py {what}. Fix it.",
        "files": {
            f"{mod}.py": HELPERS[i % len(HELPERS)] + "\n\n" + buggy + "\n",
            f"test_{mod}.py": f"from {mod} import {fn}\n\n\ndef test_{fn}():\n    assert {visible}\n",
        },
        "hidden_tests": {
            f"tests/test_{mod}_hidden.py": f"from {mod} import {fn}\n\n\ndef test_{fn}_hidden():\n{checks}\n"
        },
        "split": "eval" if i % 6 == 5 else "train",
        "difficulty": 1,
        "metadata": {
            "path": f"{mod}.py",
            "function": fn,
            "reference_edits": [{"path": f"{mod}.py", "old": buggy, "new": fixed}],
        },
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "toy_env" / "tasks.jsonl"
    out.write_text("".join(json.dumps(task(i, b)) + "\n" for i, b in enumerate(BUGS)))
    print(f"wrote {out}")
