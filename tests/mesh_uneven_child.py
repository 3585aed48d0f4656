"""Child process for tests/test_mesh_uneven_batch.py and test_pipeline_uneven_batch.py:
`python tests/mesh_uneven_child.py [--unweighted] CONFIGS_JSON OUT_PREFIX`.

`tests/train_configs_child.py`'s runs (one runtime, weights to `OUT_PREFIX.<i>.npz`, one
JSON line); with `--unweighted` the real examples of an uneven split weigh 1 instead of
`padded·R/E` (the padding still 0): the mistake the test must catch.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import train_configs_child  # noqa: E402
from tfpar import replica_split  # noqa: E402

if __name__ == "__main__":
    if sys.argv[1] == "--unweighted":
        del sys.argv[1]
        replica_split.ReplicaSplit.weight = property(lambda split: 1.0)
    train_configs_child.main()
