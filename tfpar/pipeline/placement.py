"""Where a stage lives: one device, or one device per data-parallel replica.

A stage's placement is a device name (pipeline only) or a tuple with one device per
replica of the current `tf.distribute` strategy (pipeline x data parallel). Under a
`MirroredStrategy` over R "lead" devices, each replica runs all K stages on devices of
its own; a replicated stage's variables are the strategy's own `MirroredVariable`s, only
with their R copies on the stage's devices instead of the lead devices. Keras's optimizer
then all-reduces each stage's gradients across the replicas and updates every copy,
exactly as for any mirrored variable.

Example (4 logical CPUs, 2 replicas x 2 stages):
>>> strategy = tf.distribute.MirroredStrategy(["/device:CPU:0", "/device:CPU:1"])
>>> with strategy.scope(), variables_on(("/device:CPU:2", "/device:CPU:3")):
...     layer.build(shape)   # its MirroredVariables sit on CPU:2 and CPU:3
"""

import contextlib

import tensorflow as tf

from tfpar.errors import ConfigError


class _DeviceSet:
    """Stands in for `colocate_with` in `MirroredStrategy`'s variable creator, which then
    mirrors the variable over `_devices` instead of the strategy's own devices."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def replica_devices(placement):
    """The placement as a tuple of devices, one per replica."""
    return (placement,) if isinstance(placement, str) else tuple(placement)


@contextlib.contextmanager
def variables_on(placement):
    """Variables created in this scope live on `placement` (see the module docstring).

    Args:
        placement: a device name, or one device per replica of the current strategy.
    Raises:
        ConfigError: the placement has not one device per replica of the strategy.
    """
    devices = replica_devices(placement)
    strategy = tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    if not tf.distribute.has_strategy():
        if len(devices) != 1:
            raise ConfigError("devices", placement, "outside a tf.distribute strategy give "
                              "one device per stage")
        with tf.device(devices[0]):
            yield
        return
    local = len(strategy.extended.worker_devices)
    if len(devices) != local:
        raise ConfigError("devices", placement, f"give one device per local replica of "
                          f"{type(strategy).__name__} ({local}, of {replicas} in all)")
    if isinstance(strategy, tf.distribute.OneDeviceStrategy):
        # OneDeviceStrategy pins new variables to its device unless `colocate_with` names
        # something else; an (eager) tensor on the stage's device does.
        with tf.device(devices[0]):
            colocate = tf.constant(0)
    elif isinstance(strategy, tf.distribute.MirroredStrategy):
        colocate = _DeviceSet(devices)
    else:
        raise ConfigError("strategy", type(strategy).__name__,
                          "pipeline stages compose with OneDeviceStrategy and "
                          "MirroredStrategy")

    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = colocate
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator), tf.device(devices[0]):
        yield


def current_device(placement):
    """The device of `placement` for the replica being traced (replica 0 outside one)."""
    devices = replica_devices(placement)
    if len(devices) == 1:
        return devices[0]
    context = tf.distribute.get_replica_context()
    replica = 0 if context is None else tf.get_static_value(context.replica_id_in_sync_group)
    if replica is None:
        raise ConfigError("devices", placement, "the replica id is not known while tracing; "
                          "replicated stages need MirroredStrategy")
    # With several workers the id is global; each worker holds its own replicas' devices.
    return devices[int(replica) % len(devices)]
