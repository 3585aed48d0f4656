"""tools/side_resources.py: the line each benchmark against a PyTorch peer prints about what
each side ran with, from the dicts its JSON holds."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import side_resources  # noqa: E402


def test_each_side_in_words():
    tfpar = side_resources.tensorflow_side(
        2, {"intra_op": 0, "inter_op": 0, "env": {}, "cpus": 2}, "one CPU replica per worker")
    matched = side_resources.tensorflow_side(
        1, {"intra_op": 1, "inter_op": 2, "env": {"TF_NUM_INTEROP_THREADS": "2"}, "cpus": 2})
    torch = side_resources.torch_side(2, 1, "DDP, gloo")
    line = side_resources.resources_line({"tfpar": tfpar, "matched": matched, "torch": torch,
                                          "old": side_resources.tensorflow_side(2, None),
                                          "refs": [side_resources.torch_side(1, 1),
                                                   side_resources.torch_side(1, 2)]})
    assert line == (
        "resources: tfpar: 2 processes x TensorFlow intra-op 0, inter-op 0 (0: TensorFlow "
        "picks), 2 CPUs visible each [one CPU replica per worker]; "
        "matched: 1 process x TensorFlow intra-op 1, inter-op 2, TF_NUM_INTEROP_THREADS=2, "
        "2 CPUs visible each; "
        "torch: 2 processes x 1 thread each (torch.set_num_threads) [DDP, gloo]; "
        "old: 2 processes x TensorFlow threads not recorded; "
        "refs: 1 process x 1 thread each (torch.set_num_threads) / "
        "1 process x 2 threads each (torch.set_num_threads)")


def test_distinct_keeps_each_record_once_in_order():
    a, b = side_resources.torch_side(2, 1), side_resources.torch_side(2, 2)
    assert side_resources.distinct([a, b, dict(a), b]) == [a, b]
