"""tfpar reaches the internals of Keras, TensorFlow, tf_keras and tfmot only in `tfpar/patches`.

Outside that package, tfpar's source (walked with `ast`) may not:

1. import a private module: `keras.src`, `tensorflow.python`, `tensorflow.dtensor.python`,
   `tf_keras.src`, `tensorflow_model_optimization.python` (protobuf schemas such as
   `tensorflow.core.protobuf.*_pb2` are data formats, not code, and stay allowed); nor
   name one anywhere, comments and docstrings included (the issue's
   `grep -rn "keras.src\\|tensorflow.python" tfpar`);
2. read or write an attribute whose name starts with one underscore (`x._name`, or
   `getattr`/`hasattr`/`setattr`/`delattr(x, "_name")`) unless the object is
   - `self`, `cls` or `type(self)`: the class's own attributes (but see 5.);
   - a tfpar module, class or function (imported from `tfpar` or defined in the file):
     tfpar's own private names across its modules;
   - `super()` inside a registered override of the same name (`patches.OVERRIDES`);
   or the name is tfpar's own: it starts with `_tfpar_` (tfpar's marks on other objects),
   or `TFPAR_PRIVATE` lists it with the reason (each must be defined in tfpar and be no
   attribute of the library classes tfpar extends);
3. override a private method of another library's class (found at run time: a method
   `_name` of a tfpar class that one of its library base classes, or a Keras optimizer
   for the optimizer mixins, also has) except at a site `patches.OVERRIDES` lists;
4. assign or delete a library's attribute: a dunder attribute of anything but `self` or
   a tfpar class (`tf.Tensor.__getitem__ = …`, `obj.__class__ = …`), or any attribute
   of an imported library module or of something reached from one
   (`tf_core.Variable._initialize = …`);
5. call through `self` a private method (or read a private class attribute) of a library
   class it extends or, for the optimizer mixins, of a Keras optimizer, that the class
   does not define itself, except at a site `patches.SELF_CALLS` lists (a library's
   private instance attributes read through `self` are not seen: they are the library
   base's state, read by the overrides of 3., whose entries check the code around them).
"""

import ast
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tfpar"
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.dtensor.python",
                   "tf_keras.src", "tensorflow_model_optimization.python")
# As the grep reads it (`.` any character: `tensorflow/python` counts too).
_PRIVATE_TEXT = re.compile(r"keras.src|tensorflow.python|tf_keras.src|"
                           r"tensorflow_model_optimization.python")
# tfpar's own private names used on an object that is not `self` (name -> why it is tfpar's).
TFPAR_PRIVATE = {
    "_compression_start": "tfpar.compression.aggregator.Aggregator's, read by the auto "
                          "aggregator on the aggregator it wraps",
    "_take_path_of": "tfpar.compression.auto's, called on an aggregator copy and via super()",
    "_compress_and_exchange": "tfpar.compression.lowrank's, via super() in a subclass",
    "_takes_local_variance": "tfpar.compression.aggregator's, via super() in a subclass",
    "_step": "tfpar.checkpoint.Checkpointer's, read by tfpar.callbacks",
    "_is_chief": "tfpar.checkpoint.Checkpointer's, read by tfpar.callbacks",
    "_predict": "tfpar.layout.trainer.MeshTrainer's, called by tfpar.layout.keras_distribution",
}
# (object name, attribute): public by the library's own documentation.
PUBLIC_UNDERSCORE = {("os", "_exit"): "the documented exit of a child without cleanup"}
_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def _files():
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if (PACKAGE / "patches") not in p.parents)


def _bindings(tree):
    """Names bound to tfpar (imports from tfpar, classes and functions the file defines)
    and to other libraries (every other import)."""
    ours, theirs = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                (ours if alias.name.split(".")[0] == "tfpar" else theirs).add(name)
        elif isinstance(node, ast.ImportFrom):
            own = node.level > 0 or (node.module or "").split(".")[0] == "tfpar"
            for alias in node.names:
                (ours if own else theirs).add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            ours.add(node.name)
    return ours, theirs - ours


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_self(node):
    return ((isinstance(node, ast.Name) and node.id in ("self", "cls"))
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "type" and len(node.args) == 1
                and _is_self(node.args[0])))


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _dunder(name):
    return name.startswith("__") and name.endswith("__")


class _Checker(ast.NodeVisitor):
    def __init__(self, module, tree, overrides):
        self.module, self.overrides = module, overrides
        self.ours, self.theirs = _bindings(tree)
        self.scope = []  # enclosing class and function names
        self.problems = []

    def problem(self, node, what):
        self.problems.append(f"{self.module}:{node.lineno}: {what}")

    def visit_ClassDef(self, node):
        self.scope.append(("class", node.name))
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node):
        self.scope.append(("def", node.name))
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.startswith(PRIVATE_MODULES):
                self.problem(node, f"imports {alias.name}")

    def visit_ImportFrom(self, node):
        module = node.module or ""
        full = [module] + [f"{module}.{alias.name}" for alias in node.names]
        if node.level == 0 and any(m.startswith(PRIVATE_MODULES) for m in full):
            self.problem(node, f"imports from {module}")

    def _in_registered_override(self, name):
        classes = [n for kind, n in self.scope if kind == "class"]
        functions = [n for kind, n in self.scope if kind == "def"]
        return (bool(classes) and bool(functions) and functions[-1] == name
                and (self.module, classes[-1], name) in self.overrides)

    def _allowed(self, receiver, name):
        if _is_self(receiver) or name.startswith("_tfpar_") or name in TFPAR_PRIVATE:
            return True
        if isinstance(receiver, ast.Name):
            return (receiver.id in self.ours
                    or (receiver.id, name) in PUBLIC_UNDERSCORE)
        if (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
                and receiver.func.id == "super"):
            return self._in_registered_override(name)
        return False

    def visit_Attribute(self, node):
        if _private(node.attr) and not self._allowed(node.value, node.attr):
            self.problem(node, f"private attribute {ast.unparse(node)}")
        self.generic_visit(node)

    def visit_Call(self, node):
        if (isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_CALLS
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            name = node.args[1].value
            if _private(name) and not self._allowed(node.args[0], name):
                self.problem(node, f"private attribute {ast.unparse(node)}")
            if node.func.id in ("setattr", "delattr") and _root(node.args[0]) in self.theirs:
                self.problem(node, f"changes a library's attribute: {ast.unparse(node)}")
        self.generic_visit(node)

    def _check_store(self, target):
        if not isinstance(target, ast.Attribute):
            return
        if (_dunder(target.attr) and not _is_self(target.value)
                and _root(target.value) not in self.ours):
            self.problem(target, f"swaps {ast.unparse(target)}")
        elif _root(target.value) in self.theirs:
            self.problem(target, f"changes a library's attribute: {ast.unparse(target)}")

    def visit_Assign(self, node):
        for target in node.targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                self._check_store(t)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._check_store(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node):
        for target in node.targets:
            self._check_store(target)
        self.generic_visit(node)


def check_source(module, source, overrides):
    """Problems of rules 1, 2 and 4 in `source` of tfpar module `module`."""
    problems = [f"{module}:{i}: names a private module: {line.strip()}"
                for i, line in enumerate(source.splitlines(), 1) if _PRIVATE_TEXT.search(line)]
    tree = ast.parse(source)
    checker = _Checker(module, tree, overrides)
    checker.visit(tree)
    return problems + checker.problems


def _module_name(path):
    if ROOT not in path.parents:
        return path.stem
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _overrides():
    from tfpar import patches
    return patches.OVERRIDES


def test_no_module_outside_patches_reaches_library_internals():
    overrides = _overrides()
    problems = []
    for path in _files():
        problems += check_source(_module_name(path), path.read_text(), overrides)
    assert problems == [], "\n".join(problems)


def _library_classes():
    import keras
    import tensorflow as tf
    import tf_keras
    return {keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer, keras.Model,
            keras.layers.Layer, keras.callbacks.Callback, tf.Module,
            tf_keras.optimizers.Optimizer, tf_keras.Model, tf_keras.layers.Layer}


def _tfpar_classes():
    import tfpar
    classes = []
    for info in pkgutil.walk_packages(tfpar.__path__, "tfpar."):
        if info.name.startswith("tfpar.patches") or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        classes += [obj for obj in vars(module).values()
                    if inspect.isclass(obj) and obj.__module__ == info.name]
    return classes


def private_overrides(classes, library):
    """`{(module, class, method)}`: private methods of `classes` that a library class
    (one of `library`, or a non-tfpar base in a class's own MRO) also has."""
    found = set()
    for cls in classes:
        bases = set(library) | {b for b in cls.__mro__[1:]
                                if b is not object and not b.__module__.startswith("tfpar")}
        for name, value in vars(cls).items():
            if (_private(name) and callable(value)
                    and any(hasattr(base, name) for base in bases)):
                found.add((cls.__module__, cls.__qualname__, name))
    return found


def test_private_methods_of_libraries_are_overridden_only_at_registered_sites():
    found = private_overrides(_tfpar_classes(), _library_classes())
    assert found - set(_overrides()) == set()
    assert set(_overrides()) <= found  # no stale registration


def private_self_calls(files, library):
    """`{(module, class, name)}`: `self._name` in a class of `files` where `_name` is no
    method or attribute the class body defines and is one of a `library` class."""
    found = set()
    for path in files:
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            own |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store) and _is_self(n.value)}
            for node in ast.walk(cls):
                if (isinstance(node, ast.Attribute) and _is_self(node.value)
                        and _private(node.attr) and node.attr not in own
                        and any(hasattr(base, node.attr) for base in library)):
                    found.add((_module_name(path), cls.name, node.attr))
    return found


def test_private_methods_of_libraries_are_called_through_self_only_at_registered_sites():
    from tfpar import patches
    found = private_self_calls(_files(), _library_classes())
    assert found - set(patches.SELF_CALLS) == set()
    assert set(patches.SELF_CALLS) <= found  # no stale registration
    assert set(patches.SELF_CALLS.values()) <= set(patches.REGISTRY)


def test_the_self_call_check_finds_an_unregistered_call(tmp_path):
    source = tmp_path / "example_mixin.py"
    source.write_text("class Mixin:\n    def update_step(self, g, v, lr):\n"
                      "        self._seen = self._own()\n"
                      "        return self.momentums[self._get_variable_index(v)]\n\n"
                      "    def _own(self):\n        return 1\n")
    found = private_self_calls([source], _library_classes())
    assert {(cls, name) for _, cls, name in found} == {("Mixin", "_get_variable_index")}


def test_tfpar_private_names_are_tfpars_own():
    """Each `TFPAR_PRIVATE` name is defined in tfpar and is no attribute of a library class
    tfpar extends (else it would let a library's private name through)."""
    library = _library_classes()
    text = "\n".join(p.read_text() for p in _files())
    for name in TFPAR_PRIVATE:
        assert re.search(rf"(def {name}\b|self\.{name}\s*=|\b{name}\s*=)", text), name
        assert not any(hasattr(cls, name) for cls in library), name


# Each case the issue lists, written again outside tfpar/patches: the check must refuse it.
REINTRODUCED = {
    "newaxis swap": "import tensorflow as tf\ntf.Tensor.__getitem__ = lambda t, s: t\n",
    "optimizer class swap": "def f(optimizer, cls):\n    optimizer.__class__ = cls\n",
    "BaseOptimizer private": "import keras\nkeras.optimizers.Optimizer._get_variable_index(o, v)\n",
    "tfmot private subclass": ("from tensorflow_model_optimization.python.core.sparsity.keras "
                               "import pruning_impl\nclass P(pruning_impl.Pruning):\n    pass\n"),
    "backend mesh write": "def f(mesh, m):\n    mesh._backend_mesh = m\n",
    "backend mesh read": "def f(mesh):\n    return getattr(mesh, '_backend_mesh', None)\n",
    "tensorflow.python import": "from tensorflow.python.eager import context\n",
    "keras.src import": "from keras.src.optimizers import base_optimizer\n",
    "tf_keras.src import": "import tf_keras.src.engine.training\n",
    "unregistered override call": ("class M:\n    def _all_reduce_sum_gradients(self, gv):\n"
                                   "        return super()._all_reduce_sum_gradients(gv)\n"),
    "model compute loss": "def f(model, x):\n    return model._compute_loss(x=x)\n",
    "coordination service": "# configured through tensorflow.python.eager.context\n",
    "module attribute patch": ("from keras.src.backend.tensorflow import core\n"
                               "import keras\nkeras.Variable._initialize = None\n"),
    "setattr on a library": "import keras\nsetattr(keras.Model, 'fit', None)\n",
}


@pytest.mark.parametrize("case", sorted(REINTRODUCED))
def test_the_check_refuses_each_listed_case_reintroduced(case):
    assert check_source("tfpar.example", REINTRODUCED[case], _overrides()), case


def test_the_check_allows_what_tfpar_does_on_its_own():
    source = ("import os\nfrom tfpar import patches\nfrom tfpar.compression import "
              "aggregator as agg\nclass A:\n    def f(self, other):\n"
              "        self._x = agg._stack_replicas(other)\n"
              "        other._tfpar_mark = True\n        os._exit(0)\n"
              "        return type(self)._x, patches.backend_mesh(other)\n")
    assert check_source("tfpar.example", source, {}) == []


def test_the_override_check_finds_an_unregistered_override():
    import keras

    class Mixin:
        def _all_reduce_sum_gradients(self, grads_and_vars):
            return grads_and_vars

    class Own(keras.layers.Layer):
        def _tfpar_helper(self):
            return None

    found = private_overrides([Mixin, Own], _library_classes())
    assert {name for _, _, name in found} == {"_all_reduce_sum_gradients"}
