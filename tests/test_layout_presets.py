"""Layout rules, presets, mesh errors and the small pieces of `tfpar.layout`, in-process
(one logical CPU; nothing here trains)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpar import models
from tfpar import layout
from tfpar.errors import ConfigError, TfparError
from tfpar.layout import newaxis, variables

CPU0 = ["/device:CPU:0"]


def _axes(model_name, model, preset_names=None):
    mesh = layout.make_mesh(1, 1, CPU0)
    rules = layout.preset_rules(preset_names or layout.model_presets(model_name))
    lm = layout.layout_map(mesh, rules)
    return {v.path: (lm[v.path].axes if lm[v.path] is not None else None)
            for v in model.weights}


def test_transformer_presets_split_mlp_attention_and_vocabulary():
    axes = _axes("transformer", models.transformer((16,), 20))
    m = "model"
    expected = {
        "embed/token/embeddings": (m, None), "embed/position/embeddings": None,
        "block_0/attn/query/kernel": (None, m, None), "block_0/attn/key/bias": (m, None),
        "block_1/attn/value/kernel": (None, m, None),
        "block_0/attn/attention_output/kernel": (m, None, None),
        "block_0/attn/attention_output/bias": None,
        "block_0/mlp_fc/kernel": (None, m), "block_0/mlp_fc/bias": (m,),
        "block_1/mlp_proj/kernel": (m, None), "block_1/mlp_proj/bias": None,
        "block_0/ln_1/gamma": None, "ln_f/beta": None,
        "lm_head/kernel": (None, m), "lm_head/bias": (m,),
    }
    for path, want in expected.items():
        assert axes[path] == want, path


def test_each_preset_alone_touches_only_its_layers():
    model = models.transformer((16,), 20)
    for name, owns in [("megatron_mlp", "mlp_"), ("attention_heads", "/attn/"),
                       ("vocab_parallel", ("embed/token", "lm_head"))]:
        axes = _axes("transformer", model, [name])
        split = [p for p, a in axes.items() if a is not None]
        assert split and all(any(o in p for o in np.atleast_1d(owns)) for p in split), name


def test_mlp_preset_is_column_then_row():
    axes = _axes("mlp", models.mlp((32,), 10, depth=4))
    assert axes["dense_0/kernel"] == (None, "model") and axes["dense_0/bias"] == ("model",)
    assert axes["dense_1/kernel"] == ("model", None) and axes["dense_1/bias"] is None
    assert axes["dense_2/kernel"] == (None, "model") and axes["dense_3/kernel"] == ("model", None)
    assert axes["logits/kernel"] is None


def test_no_preset_for_the_convnet():
    with pytest.raises(ConfigError, match="model='convnet'.*presets for mlp, transformer"):
        layout.model_presets("convnet")
    with pytest.raises(ConfigError, match="preset='rows'"):
        layout.preset_rules(["rows"])


def test_mesh_degrees_must_match_the_devices():
    with pytest.raises(ConfigError, match=r"2×2 = 4 must equal the 1 local devices.*"
                                          r"--cpu_devices=4"):
        layout.make_mesh(2, 2, CPU0)
    with pytest.raises(ConfigError, match="tensor_parallel=3 is invalid: must divide"):
        layout.make_mesh(0, 3, CPU0 * 2)
    mesh = layout.make_mesh(0, 1, CPU0)
    assert mesh.shape == (1, 1) and tuple(mesh.axis_names) == ("batch", "model")


def test_mesh_degrees_are_checked_against_cpu_devices_before_tensorflow_starts():
    # `tfpar.train.check_inputs` (the command line, test_layout_fit.py) calls this before
    # TensorFlow loads: one process's --cpu_devices logical CPUs.
    from tfpar import ParallelConfig, compat
    mesh3d = ParallelConfig(tensor_parallel=2, data_parallel=2, pipeline_stages=2,
                            microbatches=4, cpu_devices=4)
    with pytest.raises(ConfigError, match=r"2×2×2 = 8 must equal the 4 logical CPUs.*"
                                          r"--cpu_devices=8 on CPU, or --data_parallel=1$"):
        compat.check_devices(mesh3d)
    compat.check_devices(mesh3d.replace(cpu_devices=8))
    compat.check_devices(mesh3d, processes=2)  # across processes: checked once TF lists them
    with pytest.raises(ConfigError, match="tensor_parallel=3 .*must divide the 4 logical"):
        compat.check_devices(ParallelConfig(tensor_parallel=3, cpu_devices=4))
    compat.check_devices(ParallelConfig(tensor_parallel=2, cpu_devices=4))  # dp=0: all
    compat.check_devices(ParallelConfig(data_parallel=3, cpu_devices=4))  # not a mesh


def test_one_rule_gives_the_meshes_batch_size_before_and_after_tensorflow():
    from tfpar.dims import ParallelDims

    def mesh_degrees(dp, tp, pp, devices, where, cpu_hint=True):
        return ParallelDims(dp=dp, tp=tp, pp=pp).on_devices(devices, where, cpu_hint).dp
    # data_parallel=0: what tensor_parallel × pipeline_stages leave (a pipeline of meshes too)
    assert mesh_degrees(0, 2, 2, 8, "local devices") == 2
    assert mesh_degrees(0, 4, 1, 8, "local devices") == 2
    assert mesh_degrees(2, 2, 2, 8, "local devices") == 2
    with pytest.raises(ConfigError, match=r"^pipeline_stages=2 .*2×2×2 = 8 must equal the 6 "
                                          r"local devices; use --cpu_devices=8 on CPU$"):
        mesh_degrees(2, 2, 2, 6, "local devices")
    # Across processes --cpu_devices is not the count: no hint naming it.
    with pytest.raises(ConfigError, match=r"2×2 = 4 must equal the 8 devices of 2 processes "
                                          r"× 4; use --data_parallel=4$"):
        mesh_degrees(2, 2, 1, 8, "devices of 2 processes × 4", cpu_hint=False)
    with pytest.raises(ConfigError, match=r"^tensor_parallel=2 .*tensor_parallel × "
                                          r"pipeline_stages = 2×3 must divide the 8 "):
        mesh_degrees(0, 2, 3, 8, "local devices")


def test_layout_falls_back_to_whole_when_a_dimension_does_not_split():
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices=CPU0 * 2)
    lm = keras.distribution.LayoutMap(mesh)
    lm["head/kernel"] = (None, "model")
    dist = keras.distribution.ModelParallel(layout_map=lm, batch_dim_name="batch")
    assert variables.layout_for(dist, "head/kernel", (8, 16)).axes == (None, "model")
    assert variables.layout_for(dist, "head/kernel", (8, 17)).axes == (None, None)
    assert variables.layout_for(dist, "other", (8, 17)).axes == (None, None)
    with pytest.raises(ConfigError, match="head/kernel.*shape \\(8,\\)"):
        variables.layout_for(dist, "head/kernel", (8,))


def test_plain_variables_are_named_in_the_refusal():
    keras_var = keras.Variable(np.zeros(3), name="w")
    with pytest.raises(TfparError, match="w, counter.*variable_scope"):
        variables.check_dvariables([keras_var, tf.Variable(0, name="counter")])


def test_newaxis_rewrite_gives_the_same_values_without_strided_slice():
    x = tf.reshape(tf.range(24.0), (2, 3, 4))
    specs = [None, (slice(None), None), (Ellipsis, None), (None, Ellipsis, None),
             (slice(None), None, slice(None), None)]

    def rewritten(x):
        with newaxis.expand_dims_for_newaxis():
            return [x[s] for s in specs]

    graph = tf.function(rewritten).get_concrete_function(x).graph
    assert "StridedSlice" not in {op.type for op in graph.get_operations()}
    for spec, value in zip(specs, tf.function(rewritten)(x)):
        assert np.array_equal(value, x[spec]), spec
    with newaxis.expand_dims_for_newaxis():
        assert np.array_equal(x[0, 1:], x.numpy()[0, 1:])  # other indexing unchanged


def test_stateless_optimizer_keeps_name_and_config_and_refuses_built():
    adam = keras.optimizers.Adam(1e-3)
    config = adam.get_config()
    layout.stateless_optimizer(adam)
    assert type(adam).__name__ == "Adam" and isinstance(adam, keras.optimizers.Adam)
    assert adam.get_config() == config
    built = keras.optimizers.SGD(0.1)
    built.build([keras.Variable(np.zeros(2))])
    with pytest.raises(TfparError, match="already built"):
        layout.stateless_optimizer(built)


def test_an_output_layout_that_does_not_fit_the_output_is_refused_in_one_line():
    """Keras's `distribute_tensor` as `tfpar.layout.enable` gives it (a layout-map key
    `<layer path>/output`): checked on the traced output before any relayout."""
    from tfpar.layout.keras_distribution import distribute_tensor
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"],
                                         devices=[f"/device:CPU:{i}" for i in range(8)])
    errors = {}

    @tf.function
    def traced(x, axes):
        try:
            distribute_tensor(x, keras.distribution.TensorLayout(axes, mesh))
        except ConfigError as err:
            errors[axes] = str(err)
        try:
            distribute_tensor((x, x), keras.distribution.TensorLayout(axes, mesh))
        except ConfigError as err:
            errors["several"] = str(err)
        return x

    traced(tf.zeros([8, 6]), ("batch", "model"))  # 6 does not split over model=4
    traced(tf.zeros([8, 6]), ("batch", None, "model"))  # rank 3 for a rank-2 output
    assert "dimension 6 of the output (8, 6) does not split over model=4" in errors[
        ("batch", "model")]
    assert "give one axis entry per dimension" in errors[("batch", None, "model")]
    assert "with one output tensor" in errors["several"] and "tuple" in errors["several"]
    assert all(e.startswith("layout_map=") and "\n" not in e for e in errors.values())
    # An eager tensor on no mesh passes through untouched.
    x = tf.ones([8, 8])
    assert distribute_tensor(x, keras.distribution.TensorLayout(("batch", "model"), mesh)) is x
