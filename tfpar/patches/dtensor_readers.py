"""DTensor's packing of per-device `tf.data` iterators into one iterator on a mesh
(tensorflow 2.21.0): how a DTensor step reads host files, each device its own part.

- `per_device_iterator`: what `DTensorDataset.__iter__` does with the iterators it makes
  from one dataset of batches (`input_util._pack_iterator_resource_dtensor`), for
  iterators the caller made one per device: their resources
  (`OwnedIterator._iterator_resource`) packed replicated on the mesh's host mesh, the
  element's layout set on the packed resource (`_dtensor_device().
  set_iterator_element_layouts`), the whole wrapped in `input_util._DTensorIterator`.
  TensorFlow has no public call for it. `next()` of the result inside a DTensor function
  gives one DTensor whose piece on device i is iterator i's element, read then (the
  `tf.data` pipeline runs in the step, no Python). The check looks for those three calls
  in the packing function's source and compares the iterator's constructor signature. Used by
  tools/probe_param_offload.py: ZeRO-3's parameters in host files, each device reading its
  own piece of a layer's weight inside the step.
"""

from tensorflow.dtensor.python import api, input_util
from tensorflow.experimental import dtensor

from tfpar.patches.versions import check_entries

ENTRIES = {
    "per_device_iterator": (
        "TensorFlow's DTensor packing of per-device tf.data iterators "
        "(input_util._pack_iterator_resource_dtensor, its three calls reproduced) and "
        "input_util._DTensorIterator",
        "tools/probe_param_offload.py (ZeRO-3's parameters read from host files)"),
}
FRAGMENTS = {
    "per_device_iterator": [
        ("DTensor input_util._pack_iterator_resource_dtensor",
         lambda: input_util._pack_iterator_resource_dtensor,
         "iterator_resources = [it._iterator_resource for it in iterators]"),
        ("DTensor input_util._pack_iterator_resource_dtensor's pack",
         lambda: input_util._pack_iterator_resource_dtensor,
         "d_iterator_resource = api.pack("),
        ("DTensor input_util._pack_iterator_resource_dtensor's element layouts",
         lambda: input_util._pack_iterator_resource_dtensor,
         "api._dtensor_device().set_iterator_element_layouts("),
        ("DTensor input_util._DTensorIterator's arguments",
         lambda: ("signature", input_util._DTensorIterator.__init__),
         "(self, dtensor_components: Tuple[tensorflow.python.framework.tensor.Tensor], "
         "global_element_spec: tensorflow.python.framework.tensor.TensorSpec, "
         "layouts: Any)"),
    ],
}


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    return check_entries(names, "tensorflow", FRAGMENTS, ENTRIES)


def per_device_iterator(iterators, element_spec, layout):
    """One DTensor iterator over `iterators`. Registry entry `per_device_iterator`.

    Args:
        iterators: one `tf.data` iterator (`iter(dataset)`) per local device of
            `layout`'s mesh, in the mesh's device order, each made under that device of
            the mesh's host mesh (`with tf.device(...)`); its elements are that device's
            piece of the whole element. To read a file as it is at each `next`, its
            dataset must read nothing ahead (`options.autotune.enabled = False`,
            `options.experimental_optimization.inject_prefetch = False`): with
            `tf.data`'s defaults a call after the file changed still returned its old
            contents (tests/host_reader_child.py, TF 2.21).
        element_spec: the whole element's `tf.TensorSpec` (the DTensor's global shape).
        layout: the element's DTensor `Layout`, on the mesh the DTensor functions run on.

    Returns:
        An iterator whose `next()` (in a DTensor function, or eagerly) is one DTensor laid
        out by `layout`, its piece on device i read from `iterators[i]` at that call.

    Raises:
        ValueError: not one iterator per local device of the mesh.
    """
    host = layout.mesh.host_mesh()
    if len(iterators) != len(host.local_devices()):
        raise ValueError(f"{len(iterators)} iterators for a mesh of "
                         f"{len(host.local_devices())} local devices: one a device")
    resource = api.pack([it._iterator_resource for it in iterators],
                        dtensor.Layout.replicated(host, 0))
    api._dtensor_device().set_iterator_element_layouts(
        resource, [dtensor.Layout(layout.sharding_specs, host)])
    return input_util._DTensorIterator((resource,), element_spec, layout)
