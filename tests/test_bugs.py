"""Bug families (`strop.env.tasks.bugs`): each family's edits on a small module, formatting kept
outside the edit, only sites inside function bodies, and combined bugs."""

import difflib

from strop.env.tasks.bugs import FAMILIES, Bug, bugs, combine, function_lines, sound

MODULE = '''"""A module."""

LIMIT = 10  # module level: never a site


def clip(xs, lo, hi=3):
    out = []
    for x in xs:
        if x < lo or not x:
            continue
        if x > hi:
            out.append(hi)
        else:
            out.append(x)
    total = len(out) - 1
    return out[0:total]


class Box:
    def scale(self, k):
        self.size = self.size * k
        while k > 1:
            k //= 2
        return pow(self.size, 2) == True
'''


def changed(bug: Bug) -> list[str]:
    diff = difflib.unified_diff(MODULE.splitlines(), bug.apply(MODULE).splitlines(), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def test_every_family_edits_the_source_in_place():
    found = bugs("m.py", MODULE)
    assert {b.family for b in found} == set(FAMILIES)
    assert all(sound(b, MODULE) for b in found)
    assert all(b.line > 5 for b in found)  # nothing at module level, in a decorator or a default
    by_family = {f: [changed(b) for b in found if b.family == f] for f in FAMILIES}
    assert ["-        if x < lo or not x:", "+        if x <= lo or not x:"] in by_family["comparison"]
    assert ["-        if x < lo or not x:", "+        if x < lo and not x:"] in by_family["boolean"]
    assert ["-        if x < lo or not x:", "+        if x < lo or x:"] in by_family["boolean"]
    assert ["-    total = len(out) - 1", "+    total = len(out) + 1"] in by_family["arithmetic"]
    assert ["-            k //= 2", "+            k *= 2"] in by_family["arithmetic"]
    assert ["-    return out[0:total]", "+    return out[0:total + 1]"] in by_family["off_by_one"]
    assert ["-    return out[0:total]", "+    return out[1:total]"] in by_family["off_by_one"]
    swapped = "        if x > hi:\n            out.append(x)\n        else:\n            out.append(hi)\n"
    assert any(swapped in b.apply(MODULE) for b in found if b.family == "invert_if")  # the branches change places
    assert ["-        if x > hi:", "+        if not x > hi:"] not in by_family["invert_if"]  # it has an else
    assert ["-        if x < lo or not x:", "+        if not (x < lo or not x):"] in by_family["invert_if"]
    assert ["-        if x < lo or not x:", "-            continue"] in by_family["remove_conditional"]
    assert ["-        while k > 1:", "-            k //= 2"] in by_family["remove_loop"]
    assert ["-    total = len(out) - 1"] in by_family["remove_assignment"]
    assert ["-    return out[0:total]"] in by_family["remove_return"]
    assert ["-        return pow(self.size, 2) == True", "+        return pow(2, self.size) == True"] in by_family[
        "swap_arguments"
    ]
    assert ["-        if x > hi:", "+        if hi > x:"] in by_family["swap_operands"]
    assert ["-        return pow(self.size, 2) == True", "+        return pow(self.size, 3) == True"] in by_family[
        "wrong_constant"
    ]
    assert ["-        return pow(self.size, 2) == True", "+        return pow(self.size, 2) == False"] in by_family[
        "wrong_constant"
    ]
    assert ["-            out.append(x)", "+            out.append(hi)"] not in by_family[
        "wrong_variable"
    ]  # hi: a param
    assert any(c[0] == "-    return out[0:total]" for c in by_family["wrong_variable"])


def test_names_sizes_and_combined_bugs():
    found = bugs("m.py", MODULE)
    methods = {b.function for b in found}
    assert methods == {"clip", "Box.scale"}
    assert {b.code for b in found} == {("clip", 6), ("scale", 20)}
    assert function_lines(MODULE) == {"clip": 11, "Box.scale": 5}
    a = next(b for b in found if b.family == "comparison")
    c = next(b for b in found if b.family == "remove_return")
    both = combine([a, c], MODULE)
    assert both is not None and both.family == "combined" and len(changed(both)) == 3
    assert combine([a, a], MODULE) is None  # overlapping edits
    assert bugs("bad.py", "def f(:\n") == []
