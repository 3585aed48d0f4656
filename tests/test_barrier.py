"""`tfpar.wait_for_workers`: a barrier over the workers of a multi-worker job (two workers
on localhost, `tests/barrier_child.py`), which `tfpar.train.train` ends with so that worker
0, which hosts the coordination service, does not leave while another still runs."""

import json
import os
import sys

import pytest

from subproc import ROOT, run_module

CHILD = os.path.join(ROOT, "tests", "barrier_child.py")


def workers(mode):
    out = run_module("tfpar.launch", "--workers=2", "--timeout=150", "--", sys.executable,
                     CHILD, mode, timeout=180)
    lines = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines()
             if "] {" in line]
    return {r["worker"]: r for r in lines}


def test_worker_0_waits_for_a_late_worker():
    out = workers("late")
    assert sorted(out) == [0, 1], out
    assert out[0]["waited"] is True and out[1]["waited"] is True, out
    # Worker 1 called 3 s after starting; worker 0 returned only once it had.
    assert out[0]["returned"] >= out[1]["called"] - 0.05, out
    assert out[0]["returned"] - out[0]["called"] > 2.0, out
    # Worker 0 hosts the coordination service: it returned (and may exit) only once worker
    # 1 had the answer, here 1 s late; leaving at once cut that answer off ("Socket closed"
    # on worker 1, one CI run in ~15).
    assert out[0]["returned"] >= out[1]["answered"] - 0.05, out


def test_a_missing_worker_is_a_one_line_error_not_a_hang():
    out = workers("missing")
    err = out[0]["error"]
    assert err is not None and "\n" not in err, out
    assert "barrier 't'" in err and "timeout_s=2" in err, err
    # It gave up after about its 2 s, not after worker 1 (8 s) had gone.
    assert out[0]["returned"] - out[0]["called"] < 6.0, out


@pytest.mark.parametrize("kwargs, setting", [({"name": ""}, "name"),
                                             ({"timeout_s": 0}, "timeout_s"),
                                             ({"timeout_s": True}, "timeout_s")])
def test_bad_arguments_give_one_line(kwargs, setting):
    import tfpar
    with pytest.raises(tfpar.ConfigError) as err:
        tfpar.wait_for_workers(**kwargs)
    assert err.value.setting == setting and "\n" not in str(err.value)
