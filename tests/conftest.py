import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_MEASURED = []


@pytest.fixture(scope="session")
def report_measured():
    """`report_measured(line)`: a measured figure shown in pytest's terminal summary, under
    `-q` too (a test's own prints are hidden when it passes)."""
    return _MEASURED.append


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
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
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
