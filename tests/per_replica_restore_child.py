"""Child process for tests/test_compression_resume.py: `python
tests/per_replica_restore_child.py`, printing one JSON line.

Error-feedback residuals (per-replica variables of a `MirroredStrategy` over 2 logical
CPUs) restored from saved rows inside a `tf.function` whose rows' count is unknown while
tracing, as TensorFlow restores a checkpoint spanning several tasks: each replica's value
after restoring 2 rows (its own), 3 rows (another replica count: the sum on replica 0),
and 3 rows as an estimate (`average`: the mean on each).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from tfpar import devices
    devices.split_cpu(2)
    import tensorflow as tf

    from tfpar.compression import aggregator

    strategy = tf.distribute.MirroredStrategy(["/device:CPU:0", "/device:CPU:1"])
    with strategy.scope():
        variable = aggregator.per_replica_variable(tf.zeros([3]), "residual",
                                                   tf.VariableAggregation.MEAN)
    out = {}
    for name, rows, average in (("same", [[1, 2, 3], [4, 5, 6]], False),
                                ("other", [[1, 2, 3], [4, 5, 6], [7, 8, 9]], False),
                                ("other_average", [[1, 2, 3], [4, 5, 6], [7, 8, 9]], True)):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
        def restore(stacked, average=average):
            aggregator._restore_replicas(variable, stacked, average)

        restore(tf.constant(rows, tf.float32))
        out[name] = [v.numpy().tolist() for v in strategy.experimental_local_results(variable)]
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
