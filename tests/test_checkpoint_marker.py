"""A checkpoint directory's marker (`tfpar.json`) refuses another run's state, and only that.

A setting that means something with one compression only (`powersgd_rank`) is compared only
then: when its default changed (8 → 16), a checkpoint written by a run without PowerSGD must
still resume with the same command; one written with PowerSGD at rank 8 must not.
"""

import json

import pytest

from tfpar import ParallelConfig
from tfpar.checkpoint import _STATE_SETTINGS, MARKER, check_directory
from tfpar.errors import ConfigError


def _old_marker(folder, **settings):
    """The marker as a run of before the change wrote it: every key, rank 8."""
    saved = {k: getattr(ParallelConfig(), k) for k in _STATE_SETTINGS}
    saved.update(powersgd_rank=8, **settings)
    (folder / MARKER).write_text(json.dumps(saved))


def test_a_rank_default_change_refuses_only_powersgd_checkpoints(tmp_path):
    for compression in ("none", "topk", "auto"):
        folder = tmp_path / compression
        folder.mkdir()
        _old_marker(folder, compression=compression)
        check_directory(ParallelConfig(compression=compression, checkpoint_dir=str(folder)))
    folder = tmp_path / "powersgd"
    folder.mkdir()
    _old_marker(folder, compression="powersgd")
    with pytest.raises(ConfigError, match="powersgd_rank: saved 8, now 16"):
        check_directory(ParallelConfig(compression="powersgd", checkpoint_dir=str(folder)))
    check_directory(ParallelConfig(compression="powersgd", powersgd_rank=8,
                                   checkpoint_dir=str(folder)))
    with pytest.raises(ConfigError, match="compression: saved 'powersgd', now 'none'"):
        check_directory(ParallelConfig(compression="none", checkpoint_dir=str(folder)))
