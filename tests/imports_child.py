"""Child process for tests/test_library.py: `python tests/imports_child.py CHECK MODULES_JSON
[NAMES_JSON]`, MODULES_JSON a list of module names.

- `flags`: imports every module (and the entry points), then prints one JSON line: which of
  NAMES_JSON (flag names) became absl flags (`defined`: importing defines no flag), and the
  flags the entry points' `define_flags` add to a scratch FlagValues (`entry_flags`).
- `alone`: with the third-party packages preloaded, imports each module first in a forked
  process of its own (an import circle fails the module that starts it); prints one JSON
  line `{module: the error's traceback}` of the modules that failed.
"""

import importlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def defined_flags(modules, names):
    from absl import flags

    from tfpar import doctor, launch, report
    from tfpar.plan import __main__ as plan
    for name in modules:
        importlib.import_module(name)
    defined = sorted(n for n in names if n in flags.FLAGS)
    # The entry points' own flags, defined on a scratch FlagValues: what `run()` adds.
    entry_flags = set()
    for module in (doctor, launch, report, plan):
        scratch = flags.FlagValues()
        module.define_flags(scratch)
        entry_flags |= set(scratch)
    return {"defined": defined, "entry_flags": sorted(entry_flags)}


def imports_alone(modules):
    import numpy, tensorflow, keras, absl.flags, absl.logging, psutil  # noqa: F401,E401
    try:
        import tf_keras, tensorflow_model_optimization  # noqa: F401,E401
    except ImportError:
        pass
    failed = {}
    for name in modules:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                importlib.import_module(name)
                message = b""
            except BaseException:
                message = traceback.format_exc(limit=3).encode()[-2000:]
            os.write(write, message)
            os._exit(0)
        os.close(write)
        message = os.read(read, 4096).decode()
        os.waitpid(pid, 0)
        if message:
            failed[name] = message
    return failed


if __name__ == "__main__":
    check, modules = sys.argv[1], json.loads(sys.argv[2])
    if check == "flags":
        print(json.dumps(defined_flags(modules, json.loads(sys.argv[3]))))
    elif check == "alone":
        print(json.dumps(imports_alone(modules)))
    else:
        sys.exit(f"imports_child.py: unknown check {check!r} (flags or alone)")
