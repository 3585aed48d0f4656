"""Child process for tests/test_legacy_errors.py: `python tests/qat_refusal_child.py`.

Asks tfmot's QAT to quantize the legacy convnet (its GroupNormalization is a layer tfmot
cannot quantize) and prints the ConfigError as one JSON line `{"setting", "message"}`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar import ConfigError  # noqa: E402
from tfpar.legacy import quantization  # noqa: E402
from tfpar.models import legacy as legacy_models  # noqa: E402

try:
    quantization.quantize(legacy_models.build("convnet", (16, 16, 3), 10))
except ConfigError as err:
    print(json.dumps({"setting": err.setting, "message": str(err)}))
