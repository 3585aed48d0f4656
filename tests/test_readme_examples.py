"""The README's "Use tfpar from your own Keras script" shows the files under `examples/`
verbatim (the tests run those files: tests/test_user_script.py)."""

import os
import re

from tests.subproc import ROOT

SECTION = "## Use tfpar from your own Keras script"


def _blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"\[`(examples/[\w/]+\.py)`\]\(\1\)[^\n]*\n```python\n(.*?)```", section,
                      re.S)


def test_readme_code_blocks_equal_the_example_files():
    blocks = _blocks()
    assert len(blocks) == 4
    for path, code in blocks:
        with open(os.path.join(ROOT, path)) as f:
            assert code == f.read(), f"README block for {path} differs from the file"


def test_every_example_is_in_the_readme():
    shown = {path for path, _ in _blocks()}
    files = {os.path.relpath(os.path.join(d, n), ROOT)
             for d, _, names in os.walk(os.path.join(ROOT, "examples")) for n in names
             if n.endswith(".py") and n != "__init__.py"}
    assert files == shown
