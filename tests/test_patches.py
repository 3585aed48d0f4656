"""tfpar's patches of Keras/TensorFlow internals still find the code they were written for.

If an upgrade moves or rewrites a patched function, these tests fail before users do.
The behaviour the patches enable (plain `fit` under MultiWorkerMirroredStrategy, several
logical CPUs per worker) is tested end to end in test_train.py.
"""

import keras
import tensorflow as tf

from tfpar import patches


def test_pinned_versions_are_installed():
    assert keras.__version__ == patches.WRITTEN_FOR["keras"]
    assert tf.__version__ == patches.WRITTEN_FOR["tensorflow"]


def test_every_patch_target_is_unchanged():
    assert patches.check_targets() == []


def test_apply_replaces_every_target_and_is_idempotent():
    patches.apply()
    patches.apply()
    assert patches.is_applied()
