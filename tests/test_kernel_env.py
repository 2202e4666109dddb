"""The Triton interpreter patches of tests/kernel_env.py apply only to the tested triton versions."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import pytest


def test_installed_triton_is_in_the_pinned_range():
    pytest.importorskip("triton")
    tomllib = pytest.importorskip("tomllib")
    from tests.conftest import REPO

    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (lo, hi), = {(p.split(">=")[1].split(",")[0], p.split("<")[1]) for extra in ("infer", "dev") for p in pins[extra]
                  if p.startswith("triton")}
    assert lo == "{}.{}".format(*env.TESTED_TRITON[0]) and hi == f"3.{env.TESTED_TRITON[1][1] + 1}"
    assert env.interpreter_problem() is None


@pytest.mark.parametrize("version", ["3.5.0", "3.10.0", "4.0.0"])
def test_untested_versions_skip_with_a_reason(monkeypatch, version):
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", version)
    reason = env.interpreter_problem()
    assert reason and f"triton {version} is outside the tested range 3.6-3.9" in reason


def test_a_missing_private_function_skips_with_a_reason(monkeypatch):
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    monkeypatch.delattr(interpreter, "_convert_float")
    reason = env.interpreter_problem()
    assert reason and "lacks ['_convert_float']" in reason
