"""Legacy Keras (`tf_keras`, Keras 2) under tfpar's strategies, with tfmot pruning and QAT.

`--keras=2` trains the `tfpar.models.legacy` twin of the mlp or convnet with `tf_keras.Model.fit`
under the same strategies, data, gradient aggregators and metrics JSON as the Keras 3
trainer; `--prune_sparsity` prunes it by magnitude during training (tfmot) and `--qat`
trains it quantization-aware and exports a TFLite int8 model.

Modules: `options` (the settings and what is refused; imports no TensorFlow, so
`tfpar.config` can use it), `optimizer` (tf_keras optimizers and the aggregator hook),
`pruning`, `quantization`, `trainer` (the tf_keras model, callbacks and export).

Example (the one trainer runs it; `keras=2` picks `tfpar.backends.tf_keras`):
>>> from tfpar.train import train                                     # doctest: +SKIP
>>> result, model = train(ParallelConfig(keras=2, prune_sparsity=0.75))  # doctest: +SKIP
>>> result["pruning"]["sparsity"]                                     # doctest: +SKIP
0.75
"""
