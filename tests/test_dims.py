"""`tfpar.dims.ParallelDims`: the degrees of a layout, checked once (no TensorFlow)."""

import doctest

import pytest

from tfpar import ConfigError, ParallelConfig, dims
from tfpar.dims import ParallelDims


def test_module_example_runs():
    assert doctest.testmod(dims, raise_on_error=True).attempted > 0


def test_from_config_and_what_is_on():
    d = ParallelConfig(tensor_parallel=2, pipeline_stages=2, microbatches=4,
                       schedule="interleaved", virtual_stages=2).dims
    assert (d.dp, d.tp, d.pp, d.virtual, d.microbatches) == (0, 2, 2, 2, 4)
    assert d.tp_enabled and d.pp_enabled and d.interleaved and d.stage_models == 4
    # virtual stages count only with the interleaved schedule
    assert ParallelConfig(pipeline_stages=2, virtual_stages=3).dims.virtual == 1
    assert not ParallelConfig().dims.pp_enabled and not ParallelConfig().dims.dp_enabled


def test_a_mesh_fills_its_devices():
    d = ParallelDims(tp=2, pp=2).on_devices(8)
    assert (d.dp, d.per_stage, d.devices) == (2, 4, 8)
    assert d.stage_groups(list(range(8))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match=r"^pipeline_stages=2 .*2×2×2 = 8 must equal the 6 "):
        ParallelDims(dp=2, tp=2, pp=2).on_devices(6)
    with pytest.raises(ConfigError, match=r"^tensor_parallel=3 .*must divide the 8 local"):
        ParallelDims(tp=3).on_devices(8)


def test_replicas_of_a_strategy_hold_a_device_per_stage():
    assert ParallelDims(pp=2).replicas(4) == 2
    assert ParallelDims(pp=3).replicas(4) == 1  # the spare device is unused
    assert ParallelDims(dp=3).replicas(4) == 3
    with pytest.raises(ConfigError, match=r"^data_parallel=5 .*only 4 local device"):
        ParallelDims(dp=5).replicas(4)
    with pytest.raises(ConfigError, match="2 data-parallel replica.*need 6 devices, but 4 "
                                          "exist; use --data_parallel=1 or --cpu_devices=6"):
        ParallelDims(dp=2, pp=3).replicas(4)


def test_stages_across_workers_split_evenly():
    d = ParallelDims(dp=2, tp=2, pp=2, workers=2).on_devices(8, cpu_hint=False)
    assert d.per_worker_stage() == 2
    with pytest.raises(ConfigError, match="must be a multiple of 4"):
        ParallelDims(dp=1, tp=2, pp=2, workers=4).on_devices(4).per_worker_stage()


def test_degrees_out_of_range_name_the_setting():
    with pytest.raises(ConfigError, match="^pipeline_stages=0 "):
        ParallelDims(pp=0)
    with pytest.raises(ConfigError, match="^data_parallel=-1 "):
        ParallelDims(dp=-1)


def test_layouts_are_every_split_of_the_devices():
    splits = {(d.dp, d.tp, d.pp) for d in ParallelDims.layouts(8)}
    assert all(dp * tp * pp == 8 for dp, tp, pp in splits)
    assert len(splits) == 10  # ordered factorizations of 2^3 into three factors
