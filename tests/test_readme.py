"""The README's results block is generated from results/*.json and must be up to date."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_results_block_is_current():
    r = subprocess.run([sys.executable, "scripts/make_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_result_file_names_its_command_and_device():
    import json

    for path in (ROOT / "results").glob("*.json"):
        d = json.loads(path.read_text())
        meta = d.get("meta", d)
        assert meta.get("command"), path
        assert meta.get("gpu") or meta.get("device"), path
        assert meta.get("date"), path
