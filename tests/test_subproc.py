"""The test children's fork server (tests/zygote.py through `subproc.run`): a forked child
must see what an exec'd one sees (argv, environment, working directory, sys.path, exit
status, output) and be bounded the same way."""

import os
import shutil
import sys
import textwrap
import time

import pytest

import subproc
import zygote

REPORT = os.path.join(subproc.ROOT, "tests", "report_child.py")


FORKING = os.environ.get("TFPAR_TEST_FORK", "1") != "0"


@pytest.mark.parametrize("fresh", [False, True])
def test_a_forked_child_sees_what_an_execd_one_sees(tmp_path, fresh):
    subproc.restart_fork_server()  # a server with this environment, whatever ran before
    extra = tmp_path / "extra"
    extra.mkdir()
    script = tmp_path / "report.py"
    shutil.copy(REPORT, script)
    out = subproc.run([sys.executable, str(script), "3", "x"], cwd=str(tmp_path), check=False,
                      env={"MINE": "yes", "HOME": None, "PYTHONUNBUFFERED": "0",  # buffered
                           "PYTHONPATH": f"{extra}{os.pathsep}{subproc.ROOT}"}, fresh=fresh)
    assert out.returncode == 3 and out.stderr.endswith("to stderr\n"), out
    seen = subproc.last_json_line(out.stdout)
    assert seen == {"argv": ["3", "x"], "cwd": str(tmp_path), "mine": "yes", "unset": False,
                    "path0": str(tmp_path), "extra": True, "main": "__main__",
                    "tensorflow": FORKING and not fresh,  # forked: TensorFlow is loaded
                    "streams": [["<stdout>", False, False], ["<stderr>", False, True]]}


def test_module_and_code_children_and_a_crash():
    out = subproc.run_module("json.tool", "--help")
    assert "usage:" in out.stdout
    out = subproc.run_python("raise ValueError('planted')", check=False)
    assert out.returncode == 1 and out.stderr.rstrip().endswith("ValueError: planted")
    out = subproc.run_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                             check=False)
    assert out.returncode == -9
    out = subproc.run_python("raise KeyboardInterrupt", check=False)
    assert out.returncode == -2 and "KeyboardInterrupt" in out.stderr  # as the interpreter


def test_a_timeout_kills_the_child_and_what_it_started(tmp_path):
    marker = tmp_path / "grandchild.pid"
    code = f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(marker)!r}, "w").write(str(p.pid))
        time.sleep(60)
    """
    with pytest.raises(AssertionError, match="timed out after 8s"):
        subproc.run_python(code, timeout=8)  # time enough to start the grandchild
    pid = int(marker.read_text())
    for _ in range(50):  # SIGKILL to the group; the grandchild's parent reaps it
        if not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {pid} survived the timeout")


def test_import_time_variables_send_the_child_to_a_new_interpreter():
    loaded = zygote.loaded_environment(subproc.child_env({"TFPAR_TEST_FORK": None}))
    python = sys.executable
    assert zygote.accepts(loaded, [python, "-c", "pass"], dict(loaded))
    assert not zygote.accepts(loaded, [python, "-c", "pass"],
                              {**loaded, "TF_CPP_MIN_LOG_LEVEL": "0"})
    assert not zygote.accepts(loaded, [python, "-u", "x.py"], dict(loaded))
    assert not zygote.accepts(loaded, ["/usr/bin/python3-other", "x.py"], dict(loaded))
    assert not zygote.accepts(loaded, [python, "x.py"], {**loaded, "TFPAR_TEST_FORK": "0"})
    out = subproc.run_python("import sys; print('tensorflow' in sys.modules)",
                             env={"TF_CPP_MIN_LOG_LEVEL": "1"})
    assert out.stdout.strip() == "False"


def test_a_variable_changed_after_the_server_started_sends_the_child_to_exec(monkeypatch):
    """The server loaded TensorFlow with the environment it started with: a later change to
    an import-time variable in this process must not reach a fork of the old one."""
    subproc.run_python("pass")  # the server runs (when forking is on)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    out = subproc.run_python("import sys; print('tensorflow' in sys.modules)")
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("fresh", [False, True])
def test_psutil_reads_the_requested_command_line_and_environment(tmp_path, fresh):
    """What tests find workers and orphans by (`psutil`'s cmdline and environ, read from
    /proc) says the request's argv and environment in a forked child too."""
    code = """
        import json, os, psutil
        me = psutil.Process()
        cmdline, env = me.cmdline(), me.environ()
        while cmdline and cmdline[-1] == "":  # a forked child's unused room
            cmdline.pop()
        print(json.dumps({"cmdline": cmdline, "mine": env.get("MINE"), "home": "HOME" in env,
                          "same": env == dict(os.environ)}))
    """
    out = subproc.run_python(code, env={"MINE": f"{tmp_path} two words", "HOME": None},
                             fresh=fresh)
    seen = subproc.last_json_line(out.stdout)
    assert seen == {"cmdline": [sys.executable, "-c", textwrap.dedent(code)],
                    "mine": f"{tmp_path} two words", "home": False, "same": True}


GRANDCHILDREN = os.path.join(subproc.ROOT, "tests", "grandchildren_child.py")


@pytest.mark.parametrize("fresh", [False, True])
def test_a_forked_childs_python_children_are_forked_as_popen_sees_them(fresh):
    """`tfpar.launch`'s way of starting workers (`Popen([sys.executable, ...],
    start_new_session=True)`, pipes, poll, wait with a timeout, kill) from a forked child
    goes to the fork server and behaves as an exec'd grandchild; a child in the caller's
    own session is exec'd (a timeout's killpg must reach it)."""
    subproc.restart_fork_server()  # a server with this environment, whatever ran before
    seen = subproc.last_json_line(subproc.run([sys.executable, GRANDCHILDREN],
                                              fresh=fresh).stdout)
    routed = FORKING and not fresh
    assert seen == {"loaded": str(routed), "unflushed": "x", "routed": routed,
                    "timed_out": True, "polled": None, "killed": -9, "exited": 7,
                    "zombie": True, "missing_cwd": "/nonexistent/dir", "upper": "ABC",
                    "same_session": True}


@pytest.mark.skipif(not FORKING, reason="TFPAR_TEST_FORK=0: no fork server")
def test_a_dead_fork_server_is_started_again():
    subproc.restart_fork_server()
    subproc.run_python("pass")  # the server runs
    server = subproc._ZYGOTE["proc"]
    server.kill()
    server.wait()
    out = subproc.run_python("import sys; print('tensorflow' in sys.modules)")
    assert out.stdout.strip() == "True"  # forked from a new server, not exec'd
    assert subproc._ZYGOTE["proc"].poll() is None


def test_the_graph_optimizer_variable_reaches_a_child_only_from_its_test(monkeypatch):
    # A `TFPAR_TEST_GRAPPLER=off` in the shell that runs pytest would turn grappler off in
    # the children of files that keep it on (tests/graph_optimizer.py): dropped, as
    # TF_CONFIG is, unless the test passes it.
    from graph_optimizer import OFF, VARIABLE
    monkeypatch.setenv(VARIABLE, "off")
    assert VARIABLE not in subproc.child_env()
    assert VARIABLE not in subproc.child_env({"MINE": "yes"})
    assert subproc.child_env(OFF)[VARIABLE] == "off"
