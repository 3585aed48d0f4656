"""`pip install` of this checkout into a virtual environment, for the tests that run tfpar
as a user installed it (tests/test_packaging.py, tests/test_user_script.py).

The environment sees the packages of the Python running the tests (TensorFlow and the rest
are already there), whether that Python is the machine's or a virtual environment's: a venv
made from inside a venv with `--system-site-packages` would see only the base interpreter's
packages, so the running Python's site-packages directories are added by a `.pth` file.
The install is offline: `--no-deps --no-build-isolation --no-index`, from a copy of the
files `pip install` reads, so the build leaves nothing in the checkout.
"""

import os
import shutil
import site
import subprocess
import sys
import sysconfig

from subproc import ROOT, run

SOURCES = ("tfpar", "models", "pyproject.toml", "README.md")


def copy_sources(dest):
    """The files `pip install` reads, copied to `dest`."""
    os.makedirs(dest, exist_ok=True)
    for name in SOURCES:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name),
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest)


def missing():
    """Why this checkout cannot be pip-installed offline here, or None."""
    if not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
        return "no pyproject.toml: tfpar cannot be pip-installed from this checkout"
    try:
        import setuptools  # (the build backend --no-build-isolation uses)
    except ImportError:
        return "the offline build needs setuptools>=70.1 in this Python (pip install setuptools)"
    return None


def parent_site_packages():
    """The site-packages directories of the Python running the tests (a venv's own, then the
    base interpreter's when the venv sees it)."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    paths += site.getsitepackages() + [site.getusersitepackages()]
    seen = []
    for path in paths:
        if path and os.path.isdir(path) and path not in seen:
            seen.append(path)
    return seen


def make_venv(base, editable=False):
    """A venv at `base/venv` with tfpar installed from a copy at `base/src` (kept when
    editable: the install points at it). Returns the venv's path."""
    source, venv = base / "src", base / "venv"
    copy_sources(source)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    inner = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, timeout=60, capture_output=True, text=True)
    with open(os.path.join(inner.stdout.strip(), "tfpar-tests-parent.pth"), "w") as f:
        f.write("\n".join(parent_site_packages()) + "\n")
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", "--disable-pip-version-check",
         *(["-e"] if editable else []), str(source)],
        timeout=300, cwd=str(base), env={"PYTHONPATH": ""})
    if not editable:
        shutil.rmtree(source)
    return venv
