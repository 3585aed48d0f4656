"""The settings of the legacy-Keras front and what it refuses, checked before TensorFlow runs.

`ParallelConfig` carries them as fields (`keras`, `prune_*`, `qat`, `export_dir`);
`option(config, name)` reads one with its default, so a config from before those fields
existed still works. `check(config)` raises one `ConfigError` naming the setting for a value
out of range; what tfmot and tf_keras cannot run in combination is in `tfpar.compat`'s
table.
"""

from tfpar.errors import ConfigError

# name -> (default, help); the flags and ParallelConfig fields come from this table.
FIELDS = {
    "keras": (3, "Keras generation to train with: 3 (keras) or 2 (tf_keras, legacy Keras; "
                 "needed by --prune_sparsity and --qat)."),
    "prune_sparsity": (0.0, "Prune to this fraction of zero weights by magnitude during "
                            "training (tfmot, --keras=2); 0 = no pruning."),
    "prune_initial_sparsity": (0.0, "Sparsity the pruning schedule starts from."),
    "prune_begin_step": (0, "Step of the first pruning mask update."),
    "prune_end_step": (0, "Step at which --prune_sparsity is reached; 0 = the last step "
                          "that is a multiple of --prune_frequency after --prune_begin_step."),
    "prune_frequency": (10, "Steps between pruning mask updates."),
    "qat": (False, "Quantization-aware training (tfmot 8-bit, --keras=2); exports a TFLite "
                   "int8 model to --export_dir."),
    "export_dir": ("", "Directory for the trained (pruned: stripped) model and, with --qat, "
                       "the TFLite int8 model; chief only."),
}


def option(config, name):
    """`config.<name>`, or its default when `config` has no such field."""
    return getattr(config, name, FIELDS[name][0])


def prune_end_step(config):
    """The step at which pruning reaches its target: `prune_end_step`, or by default the
    last step of the run on the `prune_frequency` grid that starts at `prune_begin_step`
    (tfmot reaches the target only at a mask update, and only on its end step)."""
    end = option(config, "prune_end_step")
    if end:
        return end
    begin, freq = option(config, "prune_begin_step"), option(config, "prune_frequency")
    return begin + (config.steps - begin) // freq * freq


def check(config, keras_version=None):
    """Raises `ConfigError` for a legacy-Keras setting that is invalid or not supported.

    Args:
        config: a `ParallelConfig` (with or without the fields of `FIELDS`).
        keras_version: check as if `config.keras` were this (default: `config.keras`).

    Settings tf_keras and tfmot cannot run in combination (pipelines, accumulation,
    checkpoints, QAT with mixed precision, pruning on Keras 3, ...) are rows of the
    compatibility table, `tfpar.compat`; this checks the tfmot settings' ranges.
    """
    if keras_version is None:
        keras_version = option(config, "keras")
    if keras_version not in (2, 3):
        raise ConfigError("keras", keras_version, "choose 3 (keras) or 2 (tf_keras)")
    sparsity = option(config, "prune_sparsity")
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError("prune_sparsity", sparsity, "must be in [0, 1), e.g. 0.8")
    if keras_version == 2 and sparsity:
        _check_schedule(config, sparsity)


def _check_schedule(config, sparsity):
    begin, freq = option(config, "prune_begin_step"), option(config, "prune_frequency")
    initial = option(config, "prune_initial_sparsity")
    if freq < 1:
        raise ConfigError("prune_frequency", freq, "must be an integer >= 1")
    if not 0.0 <= initial <= sparsity:
        raise ConfigError("prune_initial_sparsity", initial,
                          f"must be in [0, prune_sparsity={sparsity}]")
    if not 0 <= begin < config.steps:
        raise ConfigError("prune_begin_step", begin, f"must be in [0, steps={config.steps})")
    end = prune_end_step(config)
    if not begin < end <= config.steps:
        raise ConfigError("prune_end_step", end, f"must be in (prune_begin_step={begin}, "
                          f"steps={config.steps}]; pruning steps count from 1")
    if (end - begin) % freq:
        # tfmot updates masks only on the grid and not after end_step: the target would be
        # missed.
        fixed = begin + (end - begin) // freq * freq
        raise ConfigError("prune_end_step", end,
                          f"must be prune_begin_step + a multiple of prune_frequency={freq} "
                          f"or the target sparsity is never reached; try {fixed or begin + freq}")
