"""A KerasHub model under Keras's own ModelParallel, on TensorFlow: Gemma's layout map;
trained on a 2x2 mesh, saved with `model.save` (hub_load_one_device.py loads it in stock
Keras on one device).

python hub_model_parallel.py   (needs keras-hub: pip install tfpar[hub])
"""
import numpy as np
from tfpar.devices import split_cpu

split_cpu(4)  # 4 logical CPUs before TensorFlow starts; on real accelerators, drop this

import keras  # noqa: E402
import keras_hub  # noqa: E402
import tfpar.layout  # noqa: E402

tfpar.layout.enable()  # Keras's keras.distribution, honoured on TensorFlow
mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                     devices=keras.distribution.list_devices())
layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)  # KerasHub's own preset
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))

keras.utils.set_random_seed(0)
backbone = keras_hub.models.GemmaBackbone(  # a tiny Gemma with random weights
    vocabulary_size=128, num_layers=2, num_query_heads=2, num_key_value_heads=2,
    hidden_dim=32, intermediate_dim=64, head_dim=16)
model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
model.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              weighted_metrics=["sparse_categorical_accuracy"])

rng = np.random.default_rng(0)
token_ids = rng.integers(1, 128, size=(64, 16))
x = {"token_ids": token_ids, "padding_mask": np.ones_like(token_ids, bool)}
y = np.roll(token_ids, -1, axis=1)  # the next token
history = model.fit(x, y, sample_weight=x["padding_mask"], batch_size=16, epochs=3,
                    verbose=0)

embeddings = backbone.get_layer("token_embedding").embeddings
print("token_embedding/embeddings laid out as", embeddings.value.layout.sharding_specs)
print("loss per epoch", [round(v, 4) for v in history.history["loss"]])
model.save("gemma_mesh.keras")  # whole arrays: loads on one device, or another mesh
np.savez("gemma_mesh.npz", token_ids=token_ids,
         logits=model.predict(x, batch_size=16, verbose=0))
