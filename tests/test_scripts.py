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


def test_one_cache_refuses_none_and_several_finished_caches(tmp_path):
    """recipe.sh / ab_loss.sh pick the tokenize cache with one_cache.sh: dot (temp) folders and folders without
    summary.json are not caches; none or several finished ones are refused by name."""
    pick = lambda: subprocess.run(["bash", str(REPO / "scripts/smollm2/one_cache.sh"), str(tmp_path)],
                                  capture_output=True, text=True)
    (tmp_path / ".aaaa.tmp-12").mkdir()  # a build in progress
    (tmp_path / ".aaaa.tmp-12" / "summary.json").write_text("{}")
    (tmp_path / "bbbb").mkdir()  # a killed build of the old, non-dot temp name: no summary.json
    r = pick()
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"error: no finished data.tokenize cache (a folder with summary.json) in {tmp_path}; "
                        "run the tokenize or unpack stage\n")
    (tmp_path / "cccc").mkdir()
    (tmp_path / "cccc" / "summary.json").write_text("{}")
    r = pick()
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{tmp_path}/cccc\n", "")
    (tmp_path / "dddd").mkdir()
    (tmp_path / "dddd" / "summary.json").write_text("{}")
    r = pick()
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"error: 2 finished data.tokenize caches in {tmp_path} ({tmp_path}/cccc {tmp_path}/dddd); "
                        "which one to use is ambiguous: delete the ones not wanted\n")
