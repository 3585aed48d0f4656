import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

def pytest_configure(config):
    # Measured figures go to files in one directory that the controlling process reads at
    # the end: under pytest-xdist the tests run in worker processes (which inherit this
    # environment), and the terminal summary is written by the controller.
    if "TFPAR_MEASURED_DIR" not in os.environ:
        import tempfile
        os.environ["TFPAR_MEASURED_DIR"] = tempfile.mkdtemp(prefix="tfpar-measured-")
        config._tfpar_measured_dir = os.environ["TFPAR_MEASURED_DIR"]


def pytest_unconfigure(config):
    folder = getattr(config, "_tfpar_measured_dir", None)
    if folder:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ["TFPAR_MEASURED_DIR"]


def _measured_lines():
    folder = os.environ.get("TFPAR_MEASURED_DIR", "")
    if not os.path.isdir(folder):
        return []
    lines = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            lines.extend(line.rstrip("\n") for line in f)
    return lines


@pytest.fixture(scope="session")
def report_measured():
    """`report_measured(line)`: a measured figure shown in pytest's terminal summary, under
    `-q` too (a test's own prints are hidden when it passes), from whichever worker process
    ran the test."""
    path = os.path.join(os.environ["TFPAR_MEASURED_DIR"],
                        os.environ.get("PYTEST_XDIST_WORKER", "main") + ".txt")

    def report(line):
        with open(path, "a") as f:
            f.write(str(line).replace("\n", " ") + "\n")
    return report


@pytest.fixture(scope="session")
def installed_venv(tmp_path_factory):
    """A venv with tfpar `pip install`ed into it (tests/installing.py), made once per
    session: tests/test_packaging.py and tests/test_user_script.py share it (neither
    writes into it)."""
    import installing
    why = installing.missing()
    if why:
        pytest.skip(why)
    return installing.make_venv(tmp_path_factory.mktemp("install"))


def pytest_terminal_summary(terminalreporter):
    measured = _measured_lines()
    if measured:
        terminalreporter.section("measured")
        for line in measured:
            terminalreporter.write_line(line)
    # Skips are easy to miss under -q ("5 skipped"): say why each group skipped.
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(
            report.longrepr)
        reasons.setdefault(reason, []).append(report.nodeid.split("::")[0])
    if reasons:
        terminalreporter.section("skipped, and why")
        for reason, files in reasons.items():
            terminalreporter.write_line(f"{len(files)} in {', '.join(sorted(set(files)))}: "
                                        f"{reason}")
