"""The versions every patch was written against, and the source check they share.

Pinned in requirements.txt: tensorflow 2.21.0, keras 3.15.1, tf_keras 2.21.0,
tensorflow-model-optimization 0.8.1.
"""

import inspect

WRITTEN_FOR = {"keras": "3.15.1", "tensorflow": "2.21.0", "tf_keras": "2.21.0",
               "tensorflow_model_optimization": "0.8.1"}


def installed(library):
    """The installed version of `library` (a key of `WRITTEN_FOR`)."""
    import importlib
    return importlib.import_module(library).__version__


def text_of(target):
    """What a source check compares: `"(…)"` signature text for a `("signature", obj)`
    pair, else the source of a function or class (the docstring of a C++ binding)."""
    if isinstance(target, tuple) and target[0] == "signature":
        try:
            return str(inspect.signature(target[1]))
        except (TypeError, ValueError):
            return (getattr(target[1], "__doc__", "") or "").splitlines()[0]
    try:
        return inspect.getsource(target)
    except (TypeError, OSError):
        return getattr(target, "__doc__", "") or ""


def check_fragments(entry, library, fragments, user):
    """Problems for registry `entry`: each `(what, target getter, fragment)` of `fragments`
    whose target is gone or whose text (`text_of`) no longer contains `fragment` (equals
    it, for a signature).

    Args:
        entry: the registry name, quoted in the problem.
        library: the `WRITTEN_FOR` key whose upgrade would move the target.
        fragments: `[(what, getter, fragment)]`; `getter()` returns the target (a function,
            class, module, or `("signature", obj)`), and may raise AttributeError.
        user: who in tfpar relies on it, quoted in the problem.
    """
    problems = []
    for what, getter, fragment in fragments:
        try:
            target = getter()
            text = text_of(target)
        except (AttributeError, ImportError, KeyError):
            target, text = None, ""
        found = (text == fragment if isinstance(target, tuple) else fragment in text)
        if not found:
            problems.append(f"{library} {installed(library)} changed {what} (registry entry "
                            f"{entry}); {user} was written for {library} "
                            f"{WRITTEN_FOR[library]}")
    return problems


def check_entries(names, library, fragments_by_entry, entries):
    """`check_fragments` for every entry of `fragments_by_entry` ({entry: fragments}, a
    module's `FRAGMENTS`) among `names`; `entries` is the module's `ENTRIES` (whose second
    field names who in tfpar relies on each)."""
    problems = []
    for name, fragments in fragments_by_entry.items():
        if name in names:
            problems += check_fragments(name, library, fragments, entries[name][1])
    return problems
