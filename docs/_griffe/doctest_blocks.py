"""Griffe extension for the API reference: doctests become code blocks.

kdpemb's docstrings put their doctests at the docstring's own indentation
after "Example:" (so that `doctest` and `help()` read them as written).
Markdown would read `>>>` as a quote and `[...]` in the output as a link;
this fences each run of doctest lines (up to the next line that is blank
and not followed by more `>>>`) as a ```pycon block.
"""

import griffe


def fence_doctests(text):
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith(">>>"):
            out.append(lines[i])
            i += 1
            continue
        block = []
        while i < len(lines):
            if lines[i].strip():
                block.append(lines[i])
                i += 1
                continue
            following = next((line for line in lines[i:] if line.strip()), "")
            if not following.startswith(">>>"):
                break
            block.append("")
            i += 1
        out += ["```pycon", *block, "```"]
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences the doctests of every docstring that griffe loads."""

    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
