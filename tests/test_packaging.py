"""The README's main command works after the core install only (no extras)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# distribution name -> top-level module, where they differ
MODULE = {"pyyaml": "yaml"}


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in reqs}


def extras_only_modules() -> list[str]:
    """Top-level modules of packages that only an extra installs (what a core install lacks)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    extra = set().union(*(_requirement_names(v) for v in project["optional-dependencies"].values()))
    return sorted(MODULE.get(name, name) for name in extra - core)


def test_extras_are_not_needed_by_the_core():
    mods = extras_only_modules()
    assert "accelerate" not in mods  # transformers needs it to load a GGUF target (the default one)
    assert "triton" in mods and "deepspeed" in mods  # the GPU engine and the trainer stay optional


@pytest.mark.slow
def test_main_command_runs_without_the_extras():
    """``python -m infer.generate --prompt ...`` with every extras-only package made unimportable
    (``sys.modules[name] = None``: ``import`` fails and ``importlib.util.find_spec`` returns None, as
    when the package is not installed)."""
    if not GGUF.is_file():
        pytest.skip(f"missing {GGUF} (python -m infer.fetch)")
    code = (
        "import runpy, sys\n"
        f"for m in {extras_only_modules()!r}:\n"
        "    sys.modules[m] = None\n"
        # speed only: transformers parses the GGUF's metadata (49k tokenizer strings) at each config, model and
        # tokenizer load; parse it once and hand out copies (the same values; the tensors are read as before)
        "import copy, transformers.modeling_gguf_pytorch_utils as g\n"
        "real, seen = g.load_gguf_checkpoint, {}\n"
        "def once(path, return_tensors=False, **kw):\n"
        "    if return_tensors:\n"
        "        return real(path, return_tensors=True, **kw)\n"
        "    if path not in seen:\n"
        "        seen[path] = real(path, return_tensors=False, **kw)\n"
        "    return copy.deepcopy(seen[path])\n"
        "g.load_gguf_checkpoint = once\n"
        "sys.argv = ['infer.generate', '--prompt', 'hi', '--max-new-tokens', '2']\n"
        "runpy.run_module('infer.generate', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens, tau" in r.stdout
