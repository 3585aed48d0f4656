"""`pip install .` gives a working tfpar outside the repository: the package (with its model
zoo as `tfpar.models`) and the console scripts, next to a user's own package named `models`.

Installs into a virtual environment that sees the system site-packages (TensorFlow and the
rest are already there), without network: `--no-deps --no-build-isolation`.
"""

import os
import sys

import pytest

import installing
from subproc import ROOT, run, run_concurrently


def user_project(path):
    """A user's directory with its own `models` package that tfpar must not shadow."""
    os.makedirs(path / "models")
    (path / "models" / "__init__.py").write_text("WHO = 'the user'\n")
    return path


@pytest.fixture(params=[False, True], ids=["install", "editable"])
def installed(request, tmp_path):
    """(venv, where tfpar's files must be): the session's `pip install .` venv
    (tests/conftest.py, shared with tests/test_user_script.py), or `pip install -e`."""
    if not request.param:
        venv = request.getfixturevalue("installed_venv")
        return venv, str(venv)
    why = installing.missing()
    if why:
        pytest.skip(why)
    return installing.make_venv(tmp_path, editable=True), str(tmp_path / "src")


def test_pip_install_gives_working_console_scripts(tmp_path, installed):
    venv, installed_under = installed
    python = str(venv / "bin" / "python")
    user = user_project(tmp_path / "user")
    env = {"PYTHONPATH": "", "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}

    where = run([python, "-c", "import tfpar, tfpar.models, models; "
                 "print(tfpar.__file__); print(tfpar.models.__file__); print(models.WHO)"],
                cwd=str(user), env=env, timeout=120).stdout.splitlines()
    assert where[0].startswith(installed_under) and where[1].startswith(installed_under)
    assert where[2] == "the user"

    scripts = [("tfpar-train", "--compression"), ("tfpar-launch", "--workers"),
               ("tfpar-plan", "--memory_gb"), ("tfpar-doctor", "--peer_timeout_s"),
               ("tfpar-report", "--out_dir"), ("tfpar-checkpoint", "--to")]
    outs = run_concurrently([
        lambda script=script: run([str(venv / "bin" / script), "--help"], cwd=str(user),
                                  env=env, timeout=120, check=False)
        for script, _ in scripts])
    for (script, flag), out in zip(scripts, outs):
        assert flag in out.stdout, (script, out.stdout[-1500:], out.stderr[-1500:])


def test_a_checkout_finds_the_zoo_as_tfpar_models(tmp_path):
    """From a checkout (tfpar on PYTHONPATH, as the tests' children have it) `tfpar.models`
    is the top-level models/ folder, and a user's own `models` package is still theirs."""
    user = user_project(tmp_path / "user")
    where = run([sys.executable, "-c", "import tfpar.models, models; "
                 "print(tfpar.models.__file__); print(tfpar.models.build.__module__); "
                 "print(models.WHO)"], cwd=str(user), timeout=120).stdout.splitlines()
    assert where[-3:] == [os.path.join(ROOT, "models", "__init__.py"), "tfpar.models",
                          "the user"]


def test_pyproject_lists_every_package():
    """pyproject.toml names its packages (the zoo's folder is mapped to `tfpar.models`): a
    folder of tfpar/ missing from the list would be left out of `pip install .`."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    found = {os.path.relpath(folder, ROOT).replace(os.sep, ".")
             for folder, _, files in os.walk(os.path.join(ROOT, "tfpar"))
             if "__init__.py" in files}
    assert sorted(setuptools["packages"]) == sorted(found | {"tfpar.models"})
    assert setuptools["package-dir"] == {"tfpar.models": "models"}
    assert os.path.isfile(os.path.join(ROOT, "models", "__init__.py"))
    assert not os.path.exists(os.path.join(ROOT, "tfpar", "models", "__init__.py"))


def test_pyproject_pins_what_requirements_pin():
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pinned = dict(line.strip().split("==") for line in f
                      if "==" in line and not line.startswith("#"))
    declared = list(project["dependencies"]) + [
        d for extra in project["optional-dependencies"].values() for d in extra]
    for requirement in declared:
        name, version = requirement.split("==")
        assert pinned[name] == version, requirement
    # The patches need the exact TensorFlow and Keras they were written for.
    exact = {d.split("==")[0] for d in project["dependencies"] if "==" in d}
    assert {"tensorflow", "keras"} <= exact
