"""Shell scripts find the shared assets where the Python code does: $DSPINE_SHARED."""

import re
import subprocess

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").rglob("*.sh") if "SHARED" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_read_dspine_shared(script):
    line = next(x for x in script.read_text().splitlines() if re.match(r"SHARED=", x))
    resolve = lambda env: subprocess.run(["bash", "-c", f"{line}\necho $SHARED"], capture_output=True, text=True,
                                         env={"PATH": "/usr/bin:/bin", **env}).stdout.strip()
    assert resolve({"DSPINE_SHARED": "/x/shared"}) == "/x/shared"
    assert resolve({"SHARED": "/y"}) == "/y" and resolve({}) == "../shared"
    assert "DSPINE_SHARED=" in script.read_text().split("set -euo pipefail")[0]  # the usage line names it
