"""CI's own tooling: the phase timer, the budget table and the environments kept between runs.

`.ci/run` times every phase (`.ci/phase`), sets each against its budget in `.ci/budgets.tsv`
(`.ci/phases.py`) and keeps vLLM's, kvpress's and the floors' environments between runs on one
machine (`.ci/envcache`). These tests run those tools on small stand-ins, in seconds.
"""

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_only("about the repository (layout, versions, CI, docstrings), not kvlib on a device")

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci"


def _phases():
    spec = importlib.util.spec_from_file_location("ci_phases", CI / "phases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


phases = _phases()
BUDGETS = [("install", "set-up", 10), ("book", "make test", 100), ("suite", "make test", 50)]


def test_a_phase_over_its_budget_is_named_and_one_under_is_not():
    table, warnings = phases.report(BUDGETS, [("install", 4, 0), ("book", 101, 0), ("suite", 50, 0)])
    assert warnings == ["phase 'book' took 101 s, over its budget of 100 s"]
    row = {line.split()[0]: line for line in table.splitlines() if line.strip()}
    assert row["book"].endswith("over") and not row["suite"].endswith("over")
    assert re.search(r"make test\s+151\s+150$", table, re.M)  # the part: both its phases, both budgets


def test_a_failed_phase_an_unbudgeted_one_and_time_between_phases_show():
    table, warnings = phases.report(BUDGETS, [("install", 4, 0), ("book", 30, 2), ("lint", 7, 0)], wall=60)
    assert "FAILED" in next(line for line in table.splitlines() if line.startswith("book"))
    assert any("'lint'" in w and "no budget" in w for w in warnings)
    assert re.search(r"^between phases\s+19\s+-$", table, re.M)  # 60 s of wall, 41 s inside phases
    assert re.search(r"^whole run\s+1\.0 min\s+60\s", table, re.M)


def test_the_whole_run_over_its_budget_warns():
    limit = phases.TOTAL_BUDGET_S
    _, warnings = phases.report(BUDGETS, [("book", 90, 0)], wall=limit + 1)
    assert warnings == [f"the whole run took {limit + 1} s ({(limit + 1) / 60:.1f} min), over its budget of "
                        f"{limit} s ({limit // 60} min)"]
    assert phases.report(BUDGETS, [("book", 90, 0)], wall=limit)[1] == []


def test_budgets_that_allot_more_than_the_whole_run_warn():
    _, warnings = phases.report([("a", "x", phases.TOTAL_BUDGET_S), ("b", "x", 1)], [])
    assert warnings == [f".ci/budgets.tsv allots {phases.TOTAL_BUDGET_S + 1} s, more than the whole run's "
                        f"{phases.TOTAL_BUDGET_S} s"]


def test_a_malformed_budget_line_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "budgets.tsv"
    bad.write_text("book\tmake test\tten\n")
    with pytest.raises(ValueError, match=r"budgets.tsv:1: expected .*'book\\tmake test\\tten'"):
        phases.read_budgets(bad)
    bad.write_text("book\ta\t1\nbook\tb\t2\n")
    with pytest.raises(ValueError, match="listed twice"):
        phases.read_budgets(bad)


def _timed_phases() -> list[str]:
    """Every phase name CI times: `.ci/phase NAME` in .ci/run and in the Makefile's recipes."""
    text = (CI / "run").read_text() + (ROOT / "Makefile").read_text()
    return re.findall(r"\.ci/phase ([\w-]+)", text)


def test_every_timed_phase_has_a_budget_and_every_budget_a_phase_and_they_fit_the_whole_run():
    budgets = phases.read_budgets(CI / "budgets.tsv")
    names = [name for name, _, _ in budgets]
    assert sorted(names) == sorted(_timed_phases())
    assert sum(seconds for _, _, seconds in budgets) <= phases.TOTAL_BUDGET_S
    assert phases.report(budgets, [])[1] == []


def _sh(*args, env=None, check=True):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=ROOT, check=check,
                          env={**os.environ, **(env or {})})


def test_the_phase_timer_records_the_time_and_passes_the_exit_status_on(tmp_path):
    log = tmp_path / "phases.tsv"
    ok = _sh(CI / "phase", "first", "sleep", "1", env={"KVLIB_PHASES": str(log)})
    failed = _sh(CI / "phase", "second", "sh", "-c", "exit 3", env={"KVLIB_PHASES": str(log)}, check=False)
    assert failed.returncode == 3
    (first, seconds, status), second = phases.read_log(log)
    assert (first, status, second) == ("first", 0, ("second", 0, 3)) and 1 <= seconds <= 3
    assert f"== first: {seconds} s (exit 0) ==" in ok.stdout
    alone = _sh(CI / "phase", "third", "true", env={"KVLIB_PHASES": ""})  # by hand: it only prints
    assert alone.stdout.strip() == "== third: 0 s (exit 0) =="


def test_a_kept_environment_is_reused_only_once_built_and_rebuilt_when_its_key_changes(tmp_path):
    cache, link, req = tmp_path / "cache", tmp_path / ".venv-demo", tmp_path / "req.txt"
    req.write_text("pkg==1\n")
    env = {"KVLIB_ENV_CACHE": str(cache)}

    def prepare():
        return _sh(CI / "envcache", link, req, env=env).stdout

    assert "building" in prepare()
    (link / "half-built").write_text("x")  # a build that died before --done
    assert "building" in prepare() and not (link / "half-built").exists()
    (link / "built").write_text("x")
    _sh(CI / "envcache", "--done", link, env=env)
    assert "reusing" in prepare() and (link / "built").exists()
    first = link.resolve()
    req.write_text("pkg==2\n")  # a new pin: a new environment, the old one kept beside it
    assert "building" in prepare() and link.resolve() != first and first.exists()
    _sh(CI / "envcache", "--done", link, env=env)
    second = link.resolve()
    req.write_text("pkg==3\n")  # a third: the newest two stay, the oldest goes
    prepare()
    assert sorted(cache.iterdir()) == sorted([second, link.resolve()]) and not first.exists()


def test_without_a_cache_or_beside_a_real_folder_it_changes_nothing(tmp_path):
    link = tmp_path / ".venv-demo"
    out = _sh(CI / "envcache", link, CI / "floors.txt", env={"KVLIB_ENV_CACHE": ""}).stdout
    assert "built in the checkout" in out and not link.exists()
    link.mkdir()
    out = _sh(CI / "envcache", link, CI / "floors.txt", env={"KVLIB_ENV_CACHE": str(tmp_path / "c")}).stdout
    assert "used as it is" in out and link.is_dir() and not link.is_symlink()


def _checkout_with_once(tmp_path: Path, kvlib_at: Path) -> tuple[Path, Path]:
    """A stand-in checkout holding scripts/once.sh, and an interpreter whose kvlib is the one at ``kvlib_at``."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "once.sh").write_bytes((ROOT / "scripts" / "once.sh").read_bytes())
    (repo / "scripts" / "once.sh").chmod(0o755)
    (repo / "requirements.txt").write_text("pkg==1\n")
    for where in (repo, kvlib_at):
        (where / "kvlib").mkdir(parents=True, exist_ok=True)
        (where / "kvlib" / "__init__.py").write_text("")
    py = tmp_path / "python"  # takes once.sh's `-I -c CODE` and runs CODE with that kvlib importable
    py.write_text(f'#!/bin/sh\nshift\nPYTHONPATH="{kvlib_at}" exec python3 -P "$@"\n')
    py.chmod(0o755)
    return repo, py


def test_an_install_runs_once_per_checkout_and_again_when_its_inputs_change(tmp_path):
    repo, py = _checkout_with_once(tmp_path, tmp_path / "repo")
    once = [repo / "scripts" / "once.sh", "setup", py, repo / "requirements.txt", "--", "echo", "installed"]
    assert _sh(*once).stdout == "installed\n"
    assert _sh(*once).stdout == ""  # stamped, and kvlib is this checkout's: nothing to do
    (repo / "requirements.txt").write_text("pkg==2\n")
    os.utime(repo / "_build" / ".ready-setup", (1e9, 1e9))  # the stamp older than the new pin
    assert _sh(*once).stdout == "installed\n"
    failed = _sh(*once[:5], "false", check=False)  # stamped already: not run
    assert failed.returncode == 0


def test_an_install_runs_again_where_kvlib_is_another_checkouts(tmp_path):
    repo, py = _checkout_with_once(tmp_path, tmp_path / "elsewhere")
    once = [repo / "scripts" / "once.sh", "setup", py, repo / "requirements.txt", "--", "echo", "installed"]
    assert _sh(*once).stdout == "installed\n"
    assert _sh(*once).stdout == "installed\n"  # an editable install of another checkout: install here
    failing = _sh(*once[:5], "false", check=False)
    assert failing.returncode != 0  # a failed install stamps nothing and fails the target
