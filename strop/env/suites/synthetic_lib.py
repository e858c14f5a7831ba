"""The function library the `synthetic` suite builds repositories from.

Each `Fn` is a small, realistic, pure function (math, text, parsing, collections) with the
bugs that can be injected into it, grouped by family as exact (old, new) replacements of its
source, and an input generator. Expected test values are computed by running the correct
source, so no expected value is ever written by hand.
"""

from dataclasses import dataclass, field
from random import Random
from typing import Callable

FAMILIES = ("wrong_operator", "off_by_one", "wrong_constant", "swapped_arguments", "missing_case", "wrong_return")


@dataclass(frozen=True)
class Fn:
    name: str
    theme: str  # which module kind it lives in: math, text, parse, seq
    src: str
    bugs: dict[str, list[tuple[str, str]]]
    gen: Callable[[Random], tuple]  # random arguments
    edges: list[tuple] = field(default_factory=list)  # boundary arguments every hidden test includes


def _word(r: Random, lo: int = 1, hi: int = 7) -> str:
    return "".join(r.choice("abcdeilmnorstu") for _ in range(r.randint(lo, hi)))


def _ints(r: Random, lo: int = 0, hi: int = 8, a: int = -20, b: int = 40) -> list[int]:
    return [r.randint(a, b) for _ in range(r.randint(lo, hi))]


# a table, one entry per function: the formatter would spread each over 15 lines
# fmt: off
LIBRARY: list[Fn] = [
    # ---- math ----
    Fn("clamp", "math", '''
def clamp(value, low, high):
    """Limit value to the closed range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
''', {"wrong_operator": [("value > high", "value < high")],
     "wrong_return": [("        return high\n", "        return low\n")],
     "missing_case": [("    if value < low:\n        return low\n", "")]},
       lambda r: (r.randint(-20, 20), r.randint(-10, 0), r.randint(1, 10)), [(-5, 0, 5), (0, 0, 5), (5, 0, 5), (9, 0, 5)]),
    Fn("mean", "math", '''
def mean(values):
    """Arithmetic mean of a list of numbers; 0.0 for an empty list."""
    if not values:
        return 0.0
    return sum(values) / len(values)
''', {"wrong_operator": [("sum(values) / len(values)", "sum(values) // len(values)")],
     "missing_case": [("    if not values:\n        return 0.0\n", "")],
     "wrong_constant": [("return 0.0", "return 1.0")],
     "swapped_arguments": [("sum(values) / len(values)", "len(values) / sum(values)")]},
       lambda r: (_ints(r, 1, 7, -5, 30),), [([],), ([3, 4],), ([1, 2, 3, 5],)]),
    Fn("median", "math", '''
def median(values):
    """Median of a non-empty list of numbers (mean of the two middle values when even)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 0:
        return (ordered[mid - 1] + ordered[mid]) / 2
    return ordered[mid]
''', {"off_by_one": [("ordered[mid - 1] + ordered[mid]", "ordered[mid] + ordered[mid + 1]")],
     "wrong_operator": [("len(ordered) % 2 == 0", "len(ordered) % 2 != 0")],
     "missing_case": [("    if len(ordered) % 2 == 0:\n        return (ordered[mid - 1] + ordered[mid]) / 2\n", "")],
     "wrong_constant": [(") / 2\n", ") / 3\n")]},
       lambda r: (_ints(r, 1, 8, -10, 50),), [([4, 1, 3, 2],), ([5],), ([9, 1, 5],)]),
    Fn("gcd", "math", '''
def gcd(a, b):
    """Greatest common divisor of two integers, always non-negative."""
    while b:
        a, b = b, a % b
    return abs(a)
''', {"wrong_operator": [("a % b", "a // b")],
     "wrong_return": [("return abs(a)", "return abs(b)")],
     "swapped_arguments": [("a, b = b, a % b", "a, b = b, b % a")]},
       lambda r: (r.randint(-60, 200), r.randint(1, 90)), [(12, 18), (-4, 6), (7, 0), (0, 9)]),
    Fn("is_prime", "math", '''
def is_prime(n):
    """True if n is a prime number."""
    if n < 2:
        return False
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:
            return False
    return True
''', {"off_by_one": [("int(n ** 0.5) + 1", "int(n ** 0.5)")],
     "wrong_constant": [("if n < 2:", "if n < 1:")],
     "wrong_return": [("    return True\n", "    return n % 2 == 1\n")],
     "missing_case": [("    if n < 2:\n        return False\n", "")]},
       lambda r: (r.randint(-3, 120),), [(1,), (2,), (4,), (9,), (25,), (49,), (0,)]),
    Fn("factorial", "math", '''
def factorial(n):
    """n! for a non-negative integer n."""
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
''', {"off_by_one": [("range(2, n + 1)", "range(2, n)")],
     "wrong_constant": [("result = 1", "result = 2")],
     "wrong_operator": [("result *= k", "result += k")]},
       lambda r: (r.randint(0, 12),), [(0,), (1,), (2,), (5,)]),
    Fn("digit_sum", "math", '''
def digit_sum(n):
    """Sum of the decimal digits of an integer (sign ignored)."""
    n = abs(n)
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
''', {"wrong_constant": [("total += n % 10", "total += n % 9")],
     "wrong_operator": [("while n > 0:", "while n > 9:")],
     "missing_case": [("    n = abs(n)\n", "")],
     "wrong_return": [("    return total\n", "    return n\n")]},
       lambda r: (r.randint(-9999, 99999),), [(0,), (7,), (-45,), (1009,)]),
    Fn("lerp", "math", '''
def lerp(start, stop, t):
    """Linear interpolation: start at t=0, stop at t=1."""
    return start + (stop - start) * t
''', {"swapped_arguments": [("(stop - start)", "(start - stop)")],
     "wrong_operator": [("start + (stop", "start - (stop")]},
       lambda r: (r.randint(-10, 10), r.randint(-10, 30), r.choice([0, 0.25, 0.5, 1, 2])), [(0, 10, 0.5), (2, 4, 1), (5, 1, 0.25)]),
    Fn("sign", "math", '''
def sign(x):
    """-1, 0 or 1 according to the sign of x."""
    if x > 0:
        return 1
    if x < 0:
        return -1
    return 0
''', {"missing_case": [("    if x < 0:\n        return -1\n", "")],
     "wrong_operator": [("if x > 0:", "if x >= 0:")],
     "wrong_return": [("    return 0\n", "    return 1\n")]},
       lambda r: (r.randint(-50, 50),), [(0,), (3,), (-2,)]),
    Fn("percent", "math", '''
def percent(part, whole, digits=1):
    """part as a percentage of whole, rounded; 0.0 when whole is 0."""
    if whole == 0:
        return 0.0
    return round(100 * part / whole, digits)
''', {"swapped_arguments": [("100 * part / whole", "100 * whole / part")],
     "wrong_constant": [("round(100 * part", "round(10 * part")],
     "missing_case": [("    if whole == 0:\n        return 0.0\n", "")]},
       lambda r: (r.randint(1, 50), r.randint(1, 80)), [(1, 4), (0, 0), (3, 3), (2, 3)]),
    # ---- text ----
    Fn("truncate", "text", '''
def truncate(text, width, suffix="..."):
    """Shorten text to at most width characters, ending with suffix when cut."""
    if len(text) <= width:
        return text
    return text[: width - len(suffix)] + suffix
''', {"wrong_operator": [("len(text) <= width", "len(text) < width")],
     "off_by_one": [("text[: width - len(suffix)]", "text[: width - len(suffix) + 1]")],
     "wrong_return": [("        return text\n", "        return text + suffix\n")]},
       lambda r: (_word(r, 3, 14), r.randint(4, 12)), [("hello", 5), ("hello world", 8), ("abc", 4)]),
    Fn("is_palindrome", "text", '''
def is_palindrome(text):
    """True if text reads the same backwards, ignoring case and non-alphanumerics."""
    chars = [c.lower() for c in text if c.isalnum()]
    return chars == chars[::-1]
''', {"missing_case": [("c.lower() for c", "c for c")],
     "off_by_one": [("chars == chars[::-1]", "chars[1:] == chars[::-1][1:]")]},
       lambda r: (r.choice(["", "Ab", "aBa", "No lemon, no melon", "x y X", "abca", "racecar", "Step on no pets", "ab", "Aa"]) + r.choice(["", "b", "!"]),),
       [("Racecar",), ("ab",), ("abca",), ("A man, a plan: a canal, Panama",), ("xy",)]),
    Fn("count_vowels", "text", '''
def count_vowels(text):
    """Number of vowels (a, e, i, o, u; either case) in text."""
    return sum(1 for c in text.lower() if c in "aeiou")
''', {"wrong_constant": [('c in "aeiou"', 'c in "aeio"')],
     "missing_case": [("text.lower()", "text")]},
       lambda r: (_word(r, 0, 12) + r.choice(["", "U", "E"]),), [("Queue",), ("",), ("rhythm",), ("AEIOU",)]),
    Fn("slugify", "text", '''
def slugify(title):
    """Lowercase words of title joined by single dashes; other characters dropped."""
    words = []
    current = ""
    for c in title.lower():
        if c.isalnum():
            current += c
        elif current:
            words.append(current)
            current = ""
    if current:
        words.append(current)
    return "-".join(words)
''', {"missing_case": [("    if current:\n        words.append(current)\n", "")],
     "wrong_constant": [('"-".join(words)', '"_".join(words)')],
     "wrong_return": [('    return "-".join(words)\n', '    return "-".join(words[:-1] or words)\n')]},
       lambda r: (" ".join(_word(r) for _ in range(r.randint(1, 4))) + r.choice(["", "!", " "]),), [("Hello, World",), ("  a  b ",), ("one",)]),
    Fn("pad_left", "text", '''
def pad_left(text, width, fill=" "):
    """Right-align text in a field of width using fill; longer text is unchanged."""
    missing = width - len(text)
    if missing <= 0:
        return text
    return fill * missing + text
''', {"swapped_arguments": [("fill * missing + text", "text + fill * missing")],
     "off_by_one": [("missing = width - len(text)", "missing = width - len(text) - 1")],
     "wrong_operator": [("missing = width - len(text)", "missing = width + len(text)")]},
       lambda r: (_word(r, 0, 8), r.randint(0, 10), r.choice([" ", "0", "*"])), [("7", 3, "0"), ("abc", 3, " "), ("", 2, "*")]),
    Fn("camel_to_snake", "text", '''
def camel_to_snake(name):
    """Convert CamelCase or camelCase to snake_case."""
    out = []
    for i, c in enumerate(name):
        if c.isupper() and i > 0:
            out.append("_")
        out.append(c.lower())
    return "".join(out)
''', {"wrong_operator": [("i > 0", "i >= 0")],
     "wrong_constant": [('out.append("_")', 'out.append("-")')],
     "missing_case": [("out.append(c.lower())", "out.append(c)")]},
       lambda r: ("".join(_word(r, 1, 4).capitalize() if r.random() < 0.7 else _word(r, 1, 3) for _ in range(r.randint(1, 3))),),
       [("CamelCase",), ("simple",), ("getHTTPCode",)]),
    Fn("censor", "text", '''
def censor(text, word, mask="*"):
    """Replace every occurrence of word in text by mask repeated len(word) times."""
    if not word:
        return text
    return text.replace(word, mask * len(word))
''', {"swapped_arguments": [("text.replace(word, mask * len(word))", "text.replace(mask * len(word), word)")],
     "missing_case": [("    if not word:\n        return text\n", "")],
     "off_by_one": [("mask * len(word)", "mask * (len(word) - 1)")]},
       lambda r: ((w := _word(r, 2, 4)) + " " + _word(r) + " " + w, w if r.random() < 0.8 else ""),
       [("a bad word", "bad"), ("xyz", ""), ("aaa", "a")]),
    Fn("initials", "text", '''
def initials(name):
    """Upper-case initials of the words in name, e.g. 'ada lovelace' -> 'AL'."""
    return "".join(part[0].upper() for part in name.split())
''', {"missing_case": [("part[0].upper()", "part[0]")],
     "off_by_one": [("part[0].upper()", "part[1:2].upper()")]},
       lambda r: (" ".join(_word(r) for _ in range(r.randint(1, 3))),), [("ada lovelace",), ("Grace Brewster Hopper",), ("x",)]),
    # ---- parse ----
    Fn("parse_kv", "parse", '''
def parse_kv(line):
    """Parse 'a=1;b=2' into {'a': '1', 'b': '2'}; empty parts are skipped."""
    result = {}
    for part in line.split(";"):
        if not part.strip():
            continue
        key, value = part.split("=", 1)
        result[key.strip()] = value.strip()
    return result
''', {"missing_case": [("        if not part.strip():\n            continue\n", "")],
     "wrong_constant": [('part.split("=", 1)', 'part.split("=", 2)')],
     "swapped_arguments": [("result[key.strip()] = value.strip()", "result[value.strip()] = key.strip()")]},
       lambda r: (";".join(f"{_word(r, 1, 3)}={_word(r, 0, 3)}" + r.choice(["", "=x"]) for _ in range(r.randint(1, 3))) + r.choice(["", ";"]),),
       [("a=1;b=2",), ("x = y ;",), ("url=a=b",)]),
    Fn("parse_duration", "parse", '''
def parse_duration(text):
    """Seconds in a duration like '1h30m', '45s' or '2h5s' (units h, m, s)."""
    units = {"h": 3600, "m": 60, "s": 1}
    total = 0
    number = ""
    for c in text:
        if c.isdigit():
            number += c
        else:
            total += int(number) * units[c]
            number = ""
    return total
''', {"wrong_constant": [('"h": 3600', '"h": 360')],
     "wrong_operator": [("total += int(number) * units[c]", "total = int(number) * units[c]")],
     "missing_case": [('            number = ""\n', "")]},
       lambda r: ("".join(f"{r.randint(1, 59)}{u}" for u in "hms" if r.random() < 0.6) or "5s",), [("1h30m",), ("45s",), ("2h5s",)]),
    Fn("parse_int_list", "parse", '''
def parse_int_list(text):
    """Parse '1, 2,,3' into [1, 2, 3]; blank items are ignored."""
    return [int(item) for item in text.split(",") if item.strip()]
''', {"missing_case": [(" if item.strip()]", "]")],
     "wrong_constant": [('text.split(",")', 'text.split(";")')]},
       lambda r: (",".join(str(r.randint(-9, 99)) + r.choice(["", " "]) for _ in range(r.randint(1, 5))) + r.choice(["", ","]),),
       [("1, 2,,3",), ("7",), ("4,5,",)]),
    Fn("parse_version", "parse", '''
def parse_version(text):
    """'1.10.2' -> (1, 10, 2); a missing patch or minor part counts as 0."""
    parts = [int(p) for p in text.strip().split(".")]
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts[:3])
''', {"off_by_one": [("len(parts) < 3", "len(parts) < 2")],
     "wrong_constant": [("parts.append(0)", "parts.append(1)")],
     "wrong_return": [("return tuple(parts[:3])", "return tuple(parts[:2])")]},
       lambda r: (".".join(str(r.randint(0, 20)) for _ in range(r.randint(1, 3))),), [("1.10.2",), ("2",), ("3.1",)]),
    Fn("parse_bool", "parse", '''
def parse_bool(text):
    """Interpret yes/no style strings: true, yes, on, 1 -> True; anything else -> False."""
    return text.strip().lower() in ("true", "yes", "on", "1")
''', {"missing_case": [(".strip().lower()", ".strip()")],
     "wrong_constant": [('"on", "1"', '"on", "0"')]},
       lambda r: (r.choice(["true", "Yes", " ON", "1", "0", "no", "off", "False", "TRUE ", "y"]),), [("Yes",), ("1",), ("0",), ("off",)]),
    Fn("parse_range", "parse", '''
def parse_range(text):
    """'3-6' -> [3, 4, 5, 6]; a single number '4' -> [4]."""
    if "-" not in text:
        return [int(text)]
    start, stop = text.split("-")
    return list(range(int(start), int(stop) + 1))
''', {"off_by_one": [("int(stop) + 1", "int(stop)")],
     "missing_case": [('    if "-" not in text:\n        return [int(text)]\n', "")],
     "swapped_arguments": [("start, stop = text.split", "stop, start = text.split")]},
       lambda r: (f"{(a := r.randint(0, 9))}-{a + r.randint(0, 5)}" if r.random() < 0.8 else str(r.randint(0, 9)),), [("3-6",), ("4",), ("2-2",)]),
    Fn("hex_to_rgb", "parse", '''
def hex_to_rgb(code):
    """'#ff8800' -> (255, 136, 0)."""
    code = code.lstrip("#")
    return tuple(int(code[i:i + 2], 16) for i in (0, 2, 4))
''', {"wrong_constant": [("int(code[i:i + 2], 16)", "int(code[i:i + 2], 15)")],
     "off_by_one": [("code[i:i + 2]", "code[i:i + 3]")],
     "missing_case": [('    code = code.lstrip("#")\n', "")]},
       lambda r: ("#" + "".join(r.choice("0123456789abcdef") for _ in range(6)),), [("#ff8800",), ("#000000",), ("#0a0b0c",)]),
    # ---- seq ----
    Fn("chunk", "seq", '''
def chunk(items, size):
    """Split items into consecutive lists of length size (the last may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]
''', {"off_by_one": [("items[i:i + size]", "items[i:i + size - 1]")],
     "swapped_arguments": [("range(0, len(items), size)", "range(0, size, len(items) or 1)")]},
       lambda r: (_ints(r, 0, 9), r.randint(1, 4)), [([1, 2, 3, 4, 5], 2), ([], 3), ([1, 2], 5)]),
    Fn("dedupe", "seq", '''
def dedupe(items):
    """Items without repeats, keeping the first occurrence of each, in order."""
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
''', {"wrong_return": [("    return out\n", "    return sorted(seen)\n")],
     "missing_case": [("            seen.add(item)\n", "")]},
       lambda r: (_ints(r, 0, 10, 0, 6),), [([3, 1, 3, 2, 1],), ([],), ([5, 5],)]),
    Fn("rotate", "seq", '''
def rotate(items, k):
    """Rotate a list left by k positions (k may exceed the length)."""
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]
''', {"missing_case": [("    k %= len(items)\n", "")],
     "swapped_arguments": [("items[k:] + items[:k]", "items[:k] + items[k:]")],
     "wrong_return": [("        return []\n", "        return None\n")]},
       lambda r: (_ints(r, 1, 7), r.randint(0, 12)), [([1, 2, 3], 1), ([1, 2, 3], 4), ([], 2)]),
    Fn("window_sums", "seq", '''
def window_sums(items, k):
    """Sums of every run of k consecutive items."""
    return [sum(items[i:i + k]) for i in range(len(items) - k + 1)]
''', {"off_by_one": [("range(len(items) - k + 1)", "range(len(items) - k)")],
     "wrong_operator": [("items[i:i + k]", "items[i:i - k]")]},
       lambda r: (_ints(r, 2, 8), r.randint(1, 3)), [([1, 2, 3, 4], 2), ([5], 1), ([1, 2, 3], 3)]),
    Fn("top_k", "seq", '''
def top_k(counts, k):
    """The k keys with the highest counts, ties broken alphabetically."""
    ranked = sorted(counts, key=lambda key: (-counts[key], key))
    return ranked[:k]
''', {"wrong_operator": [("(-counts[key], key)", "(counts[key], key)")],
     "off_by_one": [("ranked[:k]", "ranked[:k - 1]")],
     "swapped_arguments": [("(-counts[key], key)", "(key, -counts[key])")]},
       lambda r: ({_word(r, 1, 3): r.randint(0, 9) for _ in range(r.randint(1, 6))}, r.randint(1, 3)),
       [({"a": 1, "b": 3, "c": 2}, 2), ({"x": 1, "w": 1}, 1), ({"z": 5, "a": 1}, 1)]),
    Fn("merge_sorted", "seq", '''
def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    return out + left[i:] + right[j:]
''', {"wrong_operator": [("left[i] <= right[j]", "left[i] >= right[j]")],
     "wrong_return": [("return out + left[i:] + right[j:]", "return out + left[i:]")],
     "off_by_one": [("return out + left[i:] + right[j:]", "return out + left[i + 1:] + right[j:]")]},
       lambda r: (sorted(_ints(r, 0, 5)), sorted(_ints(r, 0, 5))), [([1, 4], [2, 3, 9]), ([], [1]), ([5, 6], [])]),
    Fn("binary_search", "seq", '''
def binary_search(items, target):
    """Index of target in the sorted list items, or -1 if absent."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''', {"wrong_operator": [("while lo <= hi:", "while lo < hi:")],
     "off_by_one": [("lo, hi = 0, len(items) - 1", "lo, hi = 0, len(items) - 2")],
     "wrong_constant": [("    return -1\n", "    return 0\n")]},
       lambda r: ((s := sorted(set(_ints(r, 1, 8)))), r.choice(s + [99])), [([1, 3, 5], 5), ([1, 3, 5], 1), ([2], 2), ([1, 2], 7)]),
    Fn("group_by_length", "seq", '''
def group_by_length(words):
    """Map each word length to the words of that length, in input order."""
    groups = {}
    for word in words:
        groups.setdefault(len(word), []).append(word)
    return groups
''', {"wrong_return": [("    return groups\n", "    return dict(sorted(groups.items()))\n")],
     "missing_case": [("groups.setdefault(len(word), []).append(word)", "groups[len(word)] = [word]")]},
       lambda r: ([_word(r, 1, 4) for _ in range(r.randint(0, 6))],), [(["bb", "a", "cc"],), ([],), (["xy", "z", "ab"],)]),
    Fn("flatten", "seq", '''
def flatten(nested):
    """Flatten one level: [[1, 2], [3], 4] -> [1, 2, 3, 4]."""
    out = []
    for item in nested:
        if isinstance(item, list):
            out.extend(item)
        else:
            out.append(item)
    return out
''', {"missing_case": [("        if isinstance(item, list):\n            out.extend(item)\n        else:\n            out.append(item)\n",
                        "        out.extend(item)\n")],
     "wrong_operator": [("            out.extend(item)\n", "            out.append(item)\n")]},
       lambda r: ([_ints(r, 0, 3) if r.random() < 0.6 else r.randint(0, 9) for _ in range(r.randint(0, 5))],), [([[1, 2], [3], 4],), ([],), ([[], 5],)]),
]
# fmt: on
