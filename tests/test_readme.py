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


def _two_commands() -> list[str]:
    """The bash blocks of the README's "Two commands" section: the main job, then the tests."""
    import re

    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_ci_runs_the_readme_commands_in_order():
    """.ci/run runs the README's main command (core install only) before its test command, verbatim."""
    main, tests = _two_commands()
    assert "pip install -e . " in main and "[" not in main.split("&&")[1]  # the core install, no extras
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert main in lines and tests in lines
    assert lines.index(main) < lines.index(tests)
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    venvs = [line.split()[-1] for line in lines if line.startswith("python3 -m venv")]
    assert len(venvs) == 2 and all(f"/{v}/" in ignored for v in venvs), venvs
