"""Every script of scripts/ has a smoke mode that a test runs (tests/script_smoke.py
lists which test module runs each one); no script is left out."""

from __future__ import annotations

from tests.script_smoke import ROOT, SCRIPTS, SMOKE_TESTS


def test_every_script_has_a_smoke_test():
    scripts = {p.name for p in SCRIPTS.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKE_TESTS), "add the script's smoke test to SMOKE_TESTS"
    for script, test in SMOKE_TESTS.items():
        assert (ROOT / test).is_file(), f"{script}: {test} does not exist"
        assert script in (ROOT / test).read_text(), f"{test} does not run {script}"


def test_every_script_has_a_smoke_mode():
    """``--smoke`` is the full run with the script's ``SMOKE`` arguments. (soak.py: its
    test runs it with short arguments of its own.)"""
    for script in set(SMOKE_TESTS) - {"soak.py"}:
        source = (SCRIPTS / script).read_text()
        assert "SMOKE = [" in source and "smoke" in source, f"{script} has no --smoke"
