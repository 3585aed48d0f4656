"""The docs' examples are real: the files under `examples/` appear verbatim in the guide
"Your own Keras script" (the tests run those files: tests/test_user_script.py) or, those
under `examples/guides/`, in "The Keras guides on TensorFlow" (tests/test_guides.py), whose
tables list every line marked there `# tfpar:`; and every
`python -m tfpar.train` command in the README and the docs (guides and benchmarks) parses into a `ParallelConfig`
that `tfpar.train.check_inputs` accepts: a flag that does not exist, a value out of range or
a combination `tfpar.compat` refuses fails here. Nothing is trained (no TensorFlow)."""

import glob
import os
import re
import shlex

import pytest
from absl import flags

from tests.subproc import ROOT

GUIDE = os.path.join("docs", "guides", "keras_script.md")
KERAS_GUIDES = os.path.join("docs", "guides", "keras_guides.md")
MARKED = re.compile(r"^\s*(.*?)(?:\s+# noqa: E402)?\s+# tfpar:")
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in
                              glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]
TRAIN = "python -m tfpar.train"


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _example_blocks(page=GUIDE):
    return re.findall(r"^`(examples/[\w/]+\.py)`[^\n]*\n```python\n(.*?)^```", _read(page),
                      re.M | re.S)


@pytest.mark.parametrize("page, count", [(GUIDE, 7), (KERAS_GUIDES, 3)])
def test_guide_code_blocks_equal_the_example_files(page, count):
    blocks = _example_blocks(page)
    assert len(blocks) == count
    for path, code in blocks:
        assert code == _read(path), f"{page}: the block for {path} differs from the file"


def test_every_line_marked_for_tfpar_is_in_a_table():
    listed = set(re.findall(r"^\| `(.*?)` \|", _read(KERAS_GUIDES), re.M))
    marked = []
    for path, code in _example_blocks(KERAS_GUIDES):
        for line in code.split("\n"):
            found = MARKED.match(line)
            if found:
                marked.append((path, found.group(1)))
    assert len(marked) >= 8
    for path, text in marked:
        assert text in listed, f"{path}: {text!r} is marked but not in {KERAS_GUIDES}"


def test_every_example_is_in_the_guide():
    shown = {path for page in (GUIDE, KERAS_GUIDES) for path, _ in _example_blocks(page)}
    files = {os.path.relpath(os.path.join(d, n), ROOT)
             for d, _, names in os.walk(os.path.join(ROOT, "examples")) for n in names
             if n.endswith(".py") and n != "__init__.py"}
    assert files == shown


def _fenced(text):
    """The shell blocks of a page (fences without a language or `bash`/`sh`), dedented."""
    # Every fence pairs with the next (a closing fence is never taken for an opening one).
    for indent, language, body in re.findall(r"^( *)```(\w*)\n(.*?)^\1```", text,
                                             re.M | re.S):
        if language in ("", "bash", "sh"):
            yield "\n".join(line[len(indent):] for line in body.split("\n"))


def _inline(text):
    """Commands quoted inline (in single backticks, maybe across a line break)."""
    text = re.sub(r"^( *)```.*?^\1```", "", text, flags=re.M | re.S)
    return [span.replace("\n", " ") for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", text)
            if TRAIN in span]


def _commands(block):
    """(words after `python -m tfpar.train`, workers the launcher starts) per command line
    of a shell block: continuations joined, `NAME="..."` and the first value of a `for`
    loop substituted, comments, `...` and `--help` left out. A command naming
    `--strategy=multi_worker` runs as one worker of a cluster: at least 2 workers."""
    text = re.sub(r"\\\n\s*", " ", block)
    names = dict(re.findall(r'^(\w+)="([^"]*)"\s*$', text, re.M))
    names.update(re.findall(r"\bfor (\w+) in (\S+)", text))
    for line in text.split("\n"):
        line = line.strip()
        if line.startswith("#") or TRAIN not in line:
            continue
        for name, value in names.items():
            line = line.replace("${%s}" % name, value).replace("$" + name, value)
        head, _, tail = line.partition(TRAIN)
        tail = re.split(r";|&&|\|", tail)[0]
        workers = 1
        if "tfpar.launch" in head:
            hosts = re.search(r"--hosts=(\S+)", head)
            count = re.search(r"--workers=(\d+)", head)
            workers = (sum(int(h.split(":")[1]) for h in hosts.group(1).split(","))
                       if hosts else int(count.group(1)) if count else 1)
        argv = [w for w in shlex.split(tail) if w not in ("...", "--help")]
        if "--strategy=multi_worker" in argv:  # one worker of a cluster (TF_CONFIG set)
            workers = max(workers, 2)
        yield argv, workers


def _all_commands():
    found = []
    for page in PAGES:
        text = _read(page)
        blocks = list(_fenced(text)) + _inline(text)
        for block in blocks:
            for argv, workers in _commands(block):
                found.append((page, argv, workers))
    return found


# Inline commands that name a placeholder (`--model=M`) stand for several runs: not parsed.
PLACEHOLDER = re.compile(r"=[A-Z]$|=[A-Z]\b(?!\w)")


def test_every_train_command_in_the_docs_is_accepted(monkeypatch):
    from tfpar import flags as tfpar_flags
    from tfpar import tf_config
    from tfpar.errors import ConfigError
    from tfpar.train import check_inputs

    monkeypatch.chdir(ROOT)  # --flagfile=configs/... is relative to the repository
    commands = _all_commands()
    checked, failures = 0, []
    for page, argv, workers in commands:
        if any(PLACEHOLDER.search(word) for word in argv):
            continue
        values = flags.FlagValues()
        tfpar_flags.define_flags(values)
        environ = {}
        if workers > 1:
            addresses = [f"localhost:{23456 + i}" for i in range(workers)]
            environ["TF_CONFIG"] = tf_config.make(addresses, 0)
        try:
            values(["tfpar.train", *argv])
            check_inputs(tfpar_flags.config_from_flags(values), environ)
        except (flags.Error, ConfigError) as err:
            failures.append(f"{page}: python -m tfpar.train {' '.join(argv)}: {err}")
        checked += 1
    assert not failures, "\n".join(failures)
    # Every guide that shows a trainer command had it checked; the count is no accident.
    assert checked >= 40, checked
    pages = {page for page, _, _ in commands}
    for page in PAGES:
        if TRAIN in _read(page):
            assert page in pages, page


@pytest.mark.parametrize("argv, fails_on", [
    (["--no_such_flag=1"], "no_such_flag"),
    (["--pipeline_stages=2", "--zero_stage=1"], "zero_stage"),
    (["--strategy=multi_worker"], "TF_CONFIG"),
])
def test_the_check_fails_on_a_bad_command(argv, fails_on):
    """What the docs test would report: an unknown flag, a refused combination, a
    multi-worker strategy outside the launcher."""
    from tfpar import flags as tfpar_flags
    from tfpar.errors import ConfigError
    from tfpar.train import check_inputs
    values = flags.FlagValues()
    tfpar_flags.define_flags(values)
    with pytest.raises((flags.Error, ConfigError), match=fails_on):
        values(["tfpar.train", *argv])
        check_inputs(tfpar_flags.config_from_flags(values), {})


# The README's "What composes" table: the config each column stands for, the setting each
# row probes (a value the cell's "yes" accepts and its "refused" refuses).
COLUMNS = {"data parallel": {}, "pipeline": {"pipeline_stages": 2},
           "tensor parallel": {"tensor_parallel": 2},
           "3D (tensor × pipeline)": {"tensor_parallel": 2, "pipeline_stages": 2},
           "ZeRO-3": {"zero_stage": 3}, "`--keras=2`": {"keras": 2}}
PROBES = {"`--compression`": {"compression": "int8"},
          "`--mixed_precision`": {"mixed_precision": "bf16"},
          "`--grad_accum_steps`": {"grad_accum_steps": 2},
          "`--recompute`": {"recompute": "blocks"},
          "`--zero_stage`": {"zero_stage": 1},
          "`--offload=optimizer`": {"offload": "optimizer"},
          "`--sequence_parallel`": {"sequence_parallel": True, "model": "transformer"},
          "`--checkpoint_dir`": {"checkpoint_dir": "runs/ckpt"},
          "`--on_nan=skip_step`": {"on_nan": "skip_step"},
          "`--tensorboard_dir`": {"tensorboard_dir": "runs/tb"},
          "`--measure_comm`": {"measure_comm": True},
          "`--allreduce=hierarchical`": {"allreduce": "hierarchical"},
          "`--schedule=chimera`": {"schedule": "chimera", "microbatches": 2}}
BACKEND_WORDS = {"data_parallel": "tf.distribute", "pipeline": "tf.distribute",
                 "dtensor": "DTensor", "tf_keras": "tf_keras"}


def _composes_table():
    section = _read("README.md").split("## What composes", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.split("\n") if line.startswith("|")]
    return rows[0][1:], {row[0]: row[1:] for row in rows[2:]}


def _refusal(settings):
    from tfpar import ParallelConfig
    from tfpar.errors import ConfigError
    try:
        ParallelConfig(**settings)
    except ConfigError as err:
        return err
    return None


def _check_cell(settings, cell, probe, where):
    """`refused` must be refused (before TensorFlow), naming a probed setting; anything
    else must pass `ParallelConfig`."""
    err = _refusal(settings)
    if cell.startswith("refused"):
        assert err is not None, f"{where}: says refused, tfpar.compat accepts {settings}"
        assert err.setting.lstrip("-") in probe, f"{where}: refused for {err.setting}: {err}"
    else:
        assert err is None, f"{where}: says {cell!r}, but {settings} is refused: {err}"


def test_the_readme_composes_table_is_what_compat_decides():
    from tfpar import ParallelConfig, compat
    header, rows = _composes_table()
    assert header == list(COLUMNS), header
    assert set(PROBES) <= set(rows), set(PROBES) - set(rows)
    for column, cell in zip(COLUMNS.values(), rows["backend"]):
        assert BACKEND_WORDS[compat.backend_of(ParallelConfig(**column))] in cell, cell
    for row, probe in PROBES.items():
        for name, base, cell in zip(COLUMNS, COLUMNS.values(), rows[row]):
            if cell.startswith("("):  # the column's own setting
                continue
            _check_cell({**base, **probe}, cell, probe, f"{row} × {name}")
            if row == "`--mixed_precision`" and "fp16" in cell:  # the fp16 part of the cell
                fp16 = "refused" if "fp16 refused" in cell else "yes"
                _check_cell({**base, "mixed_precision": "fp16"}, fp16,
                            {"mixed_precision": "fp16"}, f"fp16 × {name}")
