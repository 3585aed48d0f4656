"""tfpar as a user runs it: installed into a fresh virtual environment, imported from the
user's own directory, which holds a package of their own named `models`.

Needs the repository's `pyproject.toml` and setuptools (skipped without them).
"""

import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from tests import subproc

ROOT = subproc.ROOT
EXAMPLES = os.path.join(ROOT, "examples")
# The user's environment: nothing of the repository on the path.
USER_ENV = {"PYTHONPATH": "", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.fixture(scope="module")
def venv(installed_venv):
    """The session's venv with tfpar installed (tests/conftest.py; tests/test_packaging.py
    checks the same install). Its `python SCRIPT` children in the user's environment are
    forked from a fork server the venv's interpreter runs, which imported TensorFlow and
    Keras once (tests/zygote.py; not tfpar: each child imports the installed copy itself),
    `python -m tfpar.launch` and the workers it starts too."""
    subproc.fork_server_for(_python(installed_venv), USER_ENV)
    return installed_venv


@pytest.fixture()
def project(tmp_path):
    """The user's project directory: the examples and their own `models` package."""
    shutil.copytree(EXAMPLES, tmp_path / "project")
    return tmp_path / "project"


def _python(venv):
    return str(venv / "bin" / "python")


def _launch(venv):
    # The README's form: forked from the venv's server, the launcher's workers are too (the
    # `tfpar-launch` script, exec'd, imported TensorFlow in each worker until 2026-12-05;
    # tests/test_packaging.py runs the script itself).
    return [_python(venv), "-m", "tfpar.launch"]


def test_tfpar_is_the_installed_copy(venv, project):
    out = subproc.run([_python(venv), "-c", "import tfpar; print(tfpar.__file__)"],
                      env=USER_ENV, cwd=str(project))
    assert out.stdout.strip().startswith(str(venv)), out.stdout


def test_data_parallel_example_on_two_workers(venv, project):
    out = subproc.run([*_launch(venv), "--workers=2", "--", _python(venv), "data_parallel.py"],
                      env=USER_ENV, cwd=str(project), timeout=600)
    lines = re.findall(r"worker (\d): loss ([\d.]+) -> ([\d.]+), weights (\w+), models from (\S+)",
                       out.stdout + out.stderr)
    assert sorted(w for w, *_ in lines) == ["0", "1"], out.stdout + out.stderr[-3000:]
    assert len({digest for *_, digest, _ in lines}) == 1  # the workers' weights agree
    for _, first, last, _, models_file in lines:
        assert float(last) < 0.7 * float(first)
        assert models_file == str(project / "models" / "__init__.py")


def test_pipeline_example(venv, project):
    out = subproc.run([_python(venv), "pipeline.py"], env=USER_ENV, cwd=str(project))
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < 0.5 * first


def test_pipeline_3d_example(venv, project):
    out = subproc.run([_python(venv), "pipeline_3d.py"], env=USER_ENV, cwd=str(project),
                      timeout=600)
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < 0.8 * first, out.stdout
    assert (project / "pipeline_3d.weights.h5").exists()


def test_backup_restore_example_runs_and_cleans_up(venv, project):
    out = subproc.run([_python(venv), "backup_restore.py"], env=USER_ENV, cwd=str(project))
    assert "resuming at step 0" in out.stdout and "trained to step 60" in out.stdout
    assert not (project / "backup").exists()  # deleted once fit completed, as Keras does


def _resume_script(venv, project, *args, check=True):
    shutil.copy(os.path.join(ROOT, "tests", "user_resume.py"), project / "user_resume.py")
    return subproc.run([_python(venv), "user_resume.py", *args], env=USER_ENV,
                       cwd=str(project), check=check, timeout=300)


def _weights(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def _assert_same(a, b):
    for x, y in zip(_weights(a), _weights(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def uninterrupted(venv, tmp_path_factory):
    """The uninterrupted run's weights file, as a future: it trains while the interrupted
    runs do (`.result()` waits for it)."""
    project = tmp_path_factory.mktemp("uninterrupted") / "project"
    shutil.copytree(EXAMPLES, project)

    def run():
        out = _resume_script(venv, project, "backup", "final.npz")
        assert "resuming at step 0" in out.stdout and "trained to step 60" in out.stdout
        return project / "final.npz"
    return subproc.in_background(run)


def test_backup_and_restore_after_sigkill_mid_epoch(venv, project, uninterrupted):
    shutil.copy(os.path.join(ROOT, "tests", "user_resume.py"), project / "user_resume.py")
    proc = subproc.popen([_python(venv), "user_resume.py", "backup", "final.npz", "pause", "27"],
                         cwd=str(project), env=USER_ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("paused at 27") or time.time() > deadline:
                break
        assert seen and seen[-1].startswith("paused at 27"), "".join(seen)[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    out = _resume_script(venv, project, "backup", "final.npz")
    # Saves every 7 steps: the last before the kill was step 21, mid-way through epoch 2.
    assert "resuming at step 21" in out.stdout and "trained to step 60" in out.stdout
    _assert_same(project / "final.npz", uninterrupted.result())


def test_backup_and_restore_after_an_exception_mid_epoch(venv, project, uninterrupted):
    out = _resume_script(venv, project, "backup", "final.npz", "raise", "33", check=False)
    assert out.returncode != 0 and "interrupted at step 33" in out.stderr
    out = _resume_script(venv, project, "backup", "final.npz")
    assert "resuming at step 28" in out.stdout and "trained to step 60" in out.stdout
    _assert_same(project / "final.npz", uninterrupted.result())


def test_backup_dir_with_someone_elses_files_is_refused(venv, project):
    (project / "backup").mkdir()
    (project / "backup" / "notes.txt").write_text("mine")
    out = _resume_script(venv, project, "backup", "final.npz", check=False)
    assert out.returncode != 0 and "holds files tfpar did not write" in out.stderr
    assert (project / "backup" / "notes.txt").read_text() == "mine"


def test_keras_hub_example(venv, project):
    out = subproc.run([_python(venv), "hub_model_parallel.py"], env=USER_ENV, cwd=str(project),
                      timeout=600)
    layout_line = re.search(r"laid out as (.*)", out.stdout)
    assert layout_line and layout_line.group(1) == "['model', 'batch']", out.stdout
    losses = [float(v) for v in re.findall(r"[\d.]+", out.stdout.split("loss per epoch")[1])]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout  # it learns
    # What the mesh saved with model.save loads in stock Keras on one device (no tfpar) and
    # predicts as the mesh did: the same weights, so only the sums' order differs.
    out = subproc.run([_python(venv), "hub_load_one_device.py"], env=USER_ENV,
                      cwd=str(project), timeout=300)
    diff = float(re.search(r"mesh logits\| ([\d.e+-]+)", out.stdout).group(1))
    assert diff < 1e-4 and "tfpar imported: False" in out.stdout, out.stdout
