"""The import graph of the four packages: no cycle, and the layering of docs/contracts.md.

``dspine`` imports nothing from ``infer``, ``train`` or ``data``; ``infer`` nothing from ``train`` or
``data``; ``train`` nothing from ``data`` or ``infer``; ``data`` reaches ``infer`` only through its
generation backends and the eval-set reader. The static check reads every own-package import (module level and inside
functions, which hide cycles until a code path runs); the subprocess checks import every module, in
several orders, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys

import pytest

from tests.conftest import REPO

PACKAGES = ("dspine", "infer", "train", "data")
FORBIDDEN = {"dspine": {"infer", "train", "data"}, "infer": {"train", "data"}, "train": {"data", "infer"}}
# the data modules that may import infer: the engine backend, and the eval sets read for decontamination
DATA_TO_INFER = {"data.generate", "data.decontaminate"}


def modules() -> dict[str, ast.Module]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def own_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Own-package modules imported anywhere in ``tree`` (``from pkg import mod`` resolves to pkg.mod)."""
    found = set()
    package = name if name in PACKAGES else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: own_imports(name, tree, set(mods)) for name, tree in mods.items()}


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m, stack):
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_layering():
    bad = []
    for m, deps in graph().items():
        top = m.split(".")[0]
        for d in deps:
            if d.split(".")[0] in FORBIDDEN.get(top, ()):
                bad.append(f"{m} -> {d}")
            if top == "data" and d.startswith("infer") and m not in DATA_TO_INFER:
                bad.append(f"{m} -> {d}")
    assert not bad, "forbidden imports: " + ", ".join(sorted(bad))


def _import_all(order: list[str]) -> subprocess.CompletedProcess:
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    return subprocess.run([sys.executable, "-c", code, *order], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_every_module_imports_in_any_order():
    names = sorted(modules())
    orders = [names, names[::-1], random.Random(0).sample(names, len(names))]
    for order in orders:
        r = _import_all(order)
        assert r.returncode == 0, f"import order starting {order[:3]}: {r.stderr[-2000:]}"


def test_dspine_alone_imports_no_other_package():
    names = [m for m in sorted(modules()) if m.split(".")[0] == "dspine"]
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('infer', 'train', 'data'))\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_import_dspine_is_light_and_its_classes_register_on_first_use():
    """``import dspine`` and the data tools that need neither torch nor transformers to start load neither (they took
    3.4 s when dspine/__init__ imported its model; a Ctrl-C in that time was a traceback); ``dspine.DSpineDraftModel``
    loads its module, which registers the draft with transformers' AutoConfig and AutoModel."""
    light = ("dspine", "dspine.io", "data.prepare", "data.tokenize", "data.decontaminate", "data.pack",
             "data.draft_vocab")
    code = ("import importlib, sys\n"
            f"for m in {light!r}:\n"
            "    importlib.import_module(m)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
            "import dspine\n"
            "model = dspine.DSpineDraftModel\n"
            "from transformers import AutoConfig, AutoModel\n"
            "config = AutoConfig.for_model('dspine', block_size=4)\n"
            "print(type(config) is dspine.DSpineConfig, AutoModel._model_mapping[type(config)] is model)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "True", "True"]
    with pytest.raises(AttributeError, match="module 'dspine' has no attribute 'Nope'"):
        import dspine

        dspine.Nope  # noqa: B018
