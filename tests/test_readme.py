"""What CI relies on in the README: its two set-up commands exist, and CI runs the test one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Try it.*?```bash\n(.*?)```", text, flags=re.S)
    assert block, "the README lost its 'Try it' commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_the_demo_and_test_commands_and_their_scripts_exist():
    commands = _readme_commands()
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    for command in commands:
        assert (ROOT / command.split()[1]).is_file(), command


def test_ci_runs_the_readme_test_command():
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lines = [line.strip() for line in run.splitlines() if not line.lstrip().startswith("#")]
    assert "lane main bash scripts/test.sh" in lines
    # The test script does the whole set-up itself, so a fresh clone needs nothing else.
    test_sh = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    assert "bash scripts/setup.sh" in test_sh
    assert "pytest" in test_sh
