import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The trainer's default kernels (`--cpu_kernels=auto`: oneDNN) for every child, whatever
# TensorFlow's own rule for this processor: children that import TensorFlow before calling
# `tfpar.train.train` would otherwise run the processor's default. Yours wins if set.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

def pytest_configure(config):
    # Everything the suite and its children write to the temporary directory (pytest's
    # tmp_path, TensorFlow's autograph sources, profiler logs, docstring examples'
    # `tempfile.mkdtemp()`, the fork servers' sockets) goes under one directory of this
    # session, removed when the run passes and kept (its path in the summary) when it
    # fails. Processes that end without their interpreter's exit handlers (forked test
    # calls, workers killed on purpose) would otherwise leave files in /tmp on every run:
    # ~300 autograph sources per suite run were measured there.
    if "TFPAR_TEST_TMPDIR" not in os.environ:
        import tempfile
        folder = tempfile.mkdtemp(prefix="tfpar-tests-")
        os.environ["TFPAR_TEST_TMPDIR"] = os.environ["TMPDIR"] = folder
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        config._tfpar_tmpdir = folder
    # Measured figures go to files in one directory that the controlling process reads at
    # the end: under pytest-xdist the tests run in worker processes (which inherit this
    # environment), and the terminal summary is written by the controller.
    if "TFPAR_MEASURED_DIR" not in os.environ:
        import tempfile
        os.environ["TFPAR_MEASURED_DIR"] = tempfile.mkdtemp(prefix="tfpar-measured-")
        config._tfpar_measured_dir = os.environ["TFPAR_MEASURED_DIR"]


# The files that take longest, longest first. Under `-n 2 --dist loadfile` (pytest.ini,
# with `--no-loadscope-reorder` so that the workers take files in collection order) the two
# workers start on these and the many short files fill the gaps at the end: a long file
# started last would leave the other core idle for its whole run. Files not named keep their
# collection order after them. The order: the 2026-12-06 fresh-clone run of 1,172 tests
# (23 min), its slowest 60 entries (`--durations=60`: a file's setup and calls among them
# summed), test_keras_zero3 (new; one child, ~100 s of CPU alone) among the first, with
# the files known from earlier runs to hold many tests of a few seconds each (test_faults,
# test_memory, test_zero_compression, test_multihost_netns, test_elastic_launch, test_zero,
# test_train, test_user_script) kept where their totals then placed them, then the earlier
# list's order. The 60 entries are each file's slowest, not its total: only a whole-suite run
# shows where the two workers end (docs/benchmarks/suite.md).
LONGEST_FIRST = [
    "test_keras_3d.py", "test_zero3_prefetch.py", "test_keras_mesh_codecs.py",
    "test_mesh_sequence_codecs.py", "test_keras_zero3.py", "test_faults.py",
    "test_codec_state.py",
    "test_mesh_adam_front.py", "test_memory.py", "test_zero_compression.py",
    "test_compression_dgc.py", "test_multihost_netns.py", "test_multihost_shrink.py",
    "test_elastic_launch.py", "test_mesh_codec_compose.py", "test_zero.py",
    "test_layout_pipeline.py", "test_train.py", "test_mesh_auto.py",
    "test_pipeline_chimera.py", "test_state_moves.py", "test_compression_wire.py",
    "test_zero12_codecs.py", "test_layout_mesh.py", "test_user_script.py",
    "test_reshard.py", "test_compression_integration.py", "test_compression_timing.py",
    "test_compression_nan_free.py", "test_overlap.py", "test_compression_aggregators.py",
    "test_layout_models.py", "test_checkpoint_async.py", "test_compression_resume.py",
    "test_zero_fp16.py", "test_layout_keras.py", "test_zero3_codecs.py",
    "test_legacy_train.py", "test_layout_exact.py", "test_layout_fit.py",
    "test_pipeline_executor.py", "test_zero12_adam_front.py", "test_elastic_pipeline.py",
    "test_compression_stragglers.py", "test_tensorboard_cli.py",
    "test_pipeline_uneven_batch.py", "test_pipeline_training.py",
    "test_legacy_checkpoint.py", "test_cpu_kernels.py", "test_compression_auto.py",
    "test_validation.py", "test_offload.py", "test_compression_keras.py",
    "test_hierarchical.py", "test_layout_keras_state.py", "test_mesh_uneven_batch.py",
    "test_uneven_batch.py", "test_front_moves.py", "test_elastic_mesh.py",
    "test_offload_api.py", "test_guides.py", "test_elastic.py", "test_layout_compose.py",
    "test_layout_pipeline_workers.py", "test_api.py", "test_legacy_preemption.py",
    "test_mesh_preemption.py", "test_offload_stream.py", "test_pipeline_remote_dp.py",
    "test_pipeline_remote.py", "test_fuzz.py", "test_packaging.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    config._tfpar_keep_tmpdir = exitstatus not in (0, pytest.ExitCode.NO_TESTS_COLLECTED)


def pytest_unconfigure(config):
    import shutil
    folder = getattr(config, "_tfpar_measured_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ["TFPAR_MEASURED_DIR"]
    folder = getattr(config, "_tfpar_tmpdir", None)
    if folder:
        if getattr(config, "_tfpar_keep_tmpdir", True):
            print(f"tests: the session's temporary files are kept in {folder}",
                  file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)


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
