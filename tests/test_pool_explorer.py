"""The paged pool's explorer: the notebook panel (kvbook.pool), its reading of a trace
(kvbook.pooltrace), and the website's (js/pool-explorer.js) against that reading in Chromium.

The traces are two small hand-written fixtures in tests/data, in the format kv-pool-trace/1:
``pool-trace-kvlib.json`` (10 blocks of 4 tokens, four requests, one sampled two ways, with a
prefix hit, copy-on-write, eviction, preemption and a re-admission) and ``pool-trace-vllm.json``,
the same run with block b renamed (3b + 1) mod 10 and its last step left out.
"""

import copy
import json
import re
import subprocess
import sys
from html import escape
from pathlib import Path

import pytest

from kvbook import pool
from kvbook.pool import event_text, pool_explorer, step_text
from kvbook.pooltrace import check_trace, load, state_at
from test_site import browser  # noqa: F401  (the fixture: Debian's Chromium)

pytestmark = pytest.mark.cpu_only("drives Chromium over the built site")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
KVLIB, VLLM = DATA / "pool-trace-kvlib.json", DATA / "pool-trace-vllm.json"


def rename(b: int) -> int:  # how the vLLM fixture names kvlib's block b
    return (3 * b + 1) % 10


# -- the reading of a trace -------------------------------------------------------------------------

def test_state_at_replays_the_fixture():
    t = load(KVLIB)
    s = state_at(t, 3)  # 0 finished (blocks 1 and 0 given back; 0 still 1's), 2.1 copied block 5 to 6
    assert s["tables"] == {"1": [0, 2], "2.0": [3, 4, 5], "2.1": [3, 4, 6]}
    assert s["counts"] == {"used": 6, "cached": 1, "free": 4}
    assert s["owners"][3] == ["2.0", "2.1"] and s["owners"][0] == ["1"]
    # 2.0 and 2.1 hold 10 tokens: blocks of 4, 4 and 2; 1 holds 8: two full blocks
    assert (s["fill"][3], s["fill"][5], s["fill"][6], s["fill"][2]) == (4, 2, 2, 4)
    assert s["cached_blocks"] == [1]  # sealed at step 2, given back by 0 at step 3
    assert [e["kind"] for e in s["events"]] == ["cow", "seal", "free"]
    # step 8: 2.0 finished; its sealed blocks 3, 4, 5 and 2.1's 6 (preempted at 7) are cached,
    # block 0 (evicted at 6, then 2.0's partial last block) is free and holds no prefix
    assert state_at(t, 8)["cached_blocks"] == [3, 4, 5, 6]
    before, after = state_at(t, -1), state_at(t, 99)
    assert before["at"] is None and before["tables"] == {} and before["counts"] == {"used": 0, "cached": 0, "free": 10}
    assert after["at"] == 10 and after["events"] == [] and after["counts"]["cached"] == 8


@pytest.mark.parametrize("path", [KVLIB, VLLM])
def test_replayed_cached_blocks_are_the_engines_count(path):
    """Seal, evict and reuse, replayed from the first step, mark as many cached blocks as the
    trace counts at every step, and the tables' blocks are exactly the used ones."""
    t = load(path)
    for rec in t["steps"]:
        s = state_at(t, rec["step"])
        assert len(s["cached_blocks"]) == rec["counts"]["cached"], rec["step"]
        assert len(s["owners"]) == rec["counts"]["used"], rec["step"]
        assert not set(s["cached_blocks"]) & set(s["owners"]), rec["step"]


def test_the_two_fixtures_differ_only_in_block_ids():
    a, b = load(KVLIB), load(VLLM)
    for rec in b["steps"]:
        sa, sb = state_at(a, rec["step"]), state_at(b, rec["step"])
        assert sa["counts"] == sb["counts"] and sa["lengths"] == sb["lengths"]
        assert {k: [rename(x) for x in v] for k, v in sa["tables"].items()} == sb["tables"]


BAD = [  # (what is changed, the error, its message)
    (lambda t: t.update(format="kv-pool-trace/2"), ValueError,
     'the trace\'s format is "kv-pool-trace/2"; this explorer reads "kv-pool-trace/1"'),
    (lambda t: t["steps"][3]["tables"].update({"2.1": [3, 4, 10]}), IndexError,
     "steps[3].tables[2.1][2] is block 10, but the pool has blocks 0 to 9 (num_blocks 10)"),
    (lambda t: t["steps"][0]["events"][1].update(blocks=[0, 12]), IndexError,
     "steps[0].events[1].blocks[1] is block 12, but the pool has blocks 0 to 9"),
    (lambda t: t["steps"][3]["events"][0].update({"to": -1}), ValueError,
     "steps[3].events[0].to must be at least 0, got -1"),
    (lambda t: t["steps"][1]["tables"].update({"7": t["steps"][1]["tables"].pop("1")}), ValueError,
     'steps[1].tables names sequence "7", which is not among the requests (0, 1, 2.0, 2.1, 3)'),
    (lambda t: t["steps"][1]["events"][0].update(seq="x"), ValueError,
     'steps[1].events[0].seq names sequence "x"'),
    (lambda t: t["steps"][0]["counts"].update(free=9), ValueError,
     "steps[0].counts: used 2 + free 9 must be num_blocks 10"),
    (lambda t: t["steps"][0]["counts"].update(cached=9), ValueError,
     "steps[0].counts: cached 9 must be at most free 8"),
    (lambda t: t["steps"][1]["tables"].update({"1": [0, 1]}), ValueError,
     "steps[1].counts: used is 3, but the tables hold 2 distinct blocks"),
    (lambda t: t["steps"][0]["lengths"].update({"0": 9}), ValueError,
     "steps[0].lengths[0] is 9 tokens, more than its 2 blocks of 4 hold"),
    (lambda t: t["steps"][1]["lengths"].pop("1"), ValueError,
     "steps[1]: lengths and tables must name the same sequences; only one of them names 1"),
    (lambda t: t["steps"][2].update(step=1), ValueError,
     "steps[2].step is 1, not after the step before it (1)"),
    (lambda t: t.update(steps=[]), ValueError, "steps must be a non-empty list, got []"),
    (lambda t: t.update(num_blocks=0), ValueError, "num_blocks must be at least 1, got 0"),
    (lambda t: t.update(block_size="4"), TypeError, 'block_size must be an integer, got "4"'),
    (lambda t: t["steps"][0].pop("counts"), ValueError, 'steps[0] has no "counts" field'),
    (lambda t: t["steps"][0]["events"][0].pop("kind"), ValueError, 'steps[0].events[0] has no "kind" field'),
    (lambda t: t["steps"][0]["events"][2].pop("blocks"), ValueError,
     'steps[0].events[2] (seal) has no "blocks" field'),
    (lambda t: t["steps"][0].update(tables=[]), TypeError, "steps[0].tables must be an object, got []"),
    (lambda t: t["steps"][2]["events"][3].update(parent="2"), ValueError,
     'steps[2].events[3].parent names sequence "2"'),
]


@pytest.mark.parametrize("change, error, message", BAD)
def test_a_bad_trace_is_named(change, error, message):
    t = json.loads(KVLIB.read_text())
    change(t)
    with pytest.raises(error) as e:
        check_trace(t)
    assert str(e.value).startswith(message), str(e.value)


def test_what_the_format_allows_passes():
    """An unknown event kind (skipped: forward compatibility), steps that skip numbers, and a
    trace with no "missing" are all readable."""
    t = json.loads(KVLIB.read_text())
    t["steps"][2]["events"].append({"kind": "swap-out", "whatever": [99]})
    for i, s in enumerate(t["steps"]):
        s["step"] = 2 * i
    assert check_trace(t) is t
    assert state_at(t, 5)["at"] == 4 and state_at(t, 5)["events"] == []
    assert event_text({"kind": "swap-out"}) == "swap-out (not drawn)"


@pytest.mark.parametrize("path", [KVLIB, VLLM])
def test_fixtures_replay_with_kvlibs_own_reader(path):
    """The fixtures follow the format as kvlib's recorder reads it (its replay rebuilds every
    step's tables and counts from the events): they are not written to suit kvbook alone."""
    replay = pytest.importorskip("kvlib.paged.replay", reason="kvlib's trace reader (issue 46, item 1)")
    replay.validate(json.loads(path.read_text()))


def test_a_recorder_is_read_through_its_to_dict():
    class Recorder:  # what kvlib.paged.PoolTrace offers a reader
        def to_dict(self):
            return json.loads(KVLIB.read_text())

    assert load(Recorder()) == load(KVLIB)


def test_a_file_that_is_not_a_trace(tmp_path):
    (tmp_path / "bad.json").write_text('{"format": "kv-pool-trace/1",')
    with pytest.raises(ValueError, match=r"bad\.json is not JSON \(.* line 1"):
        load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="no trace file at"):
        load(tmp_path / "nothing.json")
    with pytest.raises(TypeError, match=r"the trace must be an object, got \[1,2\]"):
        load([1, 2])


# -- the notebook panel ------------------------------------------------------------------------------

def shown(html: str) -> list[dict]:
    """What a view's HTML shows, panel by panel: counts, tables (ids and tokens), grid, events."""
    out = []
    for part in html.split('<div class="kv-pool-panel"')[1:]:
        counts = {k: int(v) for k, v in re.findall(r'(\w+) <b data-name="\w+">(\d+)</b>', part)}
        rows = re.findall(r'<tr data-seq="([^"]+)"><td>.*?</td><td>([\d, ]*)</td><td[^>]*>(\d+)</td></tr>', part)
        tables = {k: [int(x) for x in ids.split(", ")] for k, ids, _ in rows}
        lengths = {k: int(n) for k, _, n in rows}
        grid = re.findall(r'data-block="(\d+)" data-kind="(\w+)" data-owners="([^"]*)" data-fill="(\d+)"', part)
        events = re.findall(r"<li>(.*?)</li>", part)
        out.append({"counts": counts, "tables": tables, "lengths": lengths, "events": events,
                    "grid": [(int(b), k, o.split(), int(f)) for b, k, o, f in grid]})
    return out


def expected(trace: dict, step: int) -> dict:
    """The same, read from the trace's own record of that step (not from kvbook's reading)."""
    rec = max((s for s in trace["steps"] if s["step"] <= step), key=lambda s: s["step"])
    grid = []
    for b in range(trace["num_blocks"]):
        owners = sorted(k for k, v in rec["tables"].items() if b in v)
        fill = max([min(4, rec["lengths"][k] - rec["tables"][k].index(b) * 4) for k in owners], default=0)
        grid.append((b, owners, fill))
    events = rec["events"] if rec["step"] == step else []
    return {"counts": rec["counts"], "tables": rec["tables"], "lengths": rec["lengths"],
            "events": [escape(event_text(e)) for e in events], "grid": grid}


def same(view: dict, want: dict) -> None:
    assert view["counts"] == want["counts"]
    assert view["tables"] == want["tables"] and view["lengths"] == want["lengths"]
    assert [(b, sorted(o), f) for b, _, o, f in view["grid"]] == want["grid"]
    kinds = [k for _, k, _, _ in view["grid"]]
    assert kinds.count("used") == want["counts"]["used"] and kinds.count("cached") == want["counts"]["cached"]
    assert view["events"] == want["events"]


def test_widget_follows_its_slider_and_play():
    pytest.importorskip("ipywidgets")
    t = load(KVLIB)
    panel = pool_explorer(KVLIB)
    play, slider = panel.controls["play"], panel.controls["step"]
    assert (slider.min, slider.max, slider.value) == (0, 10, 0) == (play.min, play.max, play.value)
    for step in (0, 3, 6, 7, 10):
        slider.value = step
        [view] = shown(panel.output.value)
        same(view, expected(t, step))
    play.value = 4  # a tick of the play button (sent by the front end) moves the slider
    assert slider.value == 4
    [view] = shown(panel.output.value)
    same(view, expected(t, 4))
    assert "admit 3 (0 tokens cached)" in view["events"]


def test_two_traces_side_by_side():
    pytest.importorskip("ipywidgets")
    a, b = load(KVLIB), load(VLLM)
    panel = pool_explorer(KVLIB, other=VLLM, step=6)
    assert (panel.controls["step"].min, panel.controls["step"].max) == (0, 10)  # the longer trace's
    for step in (6, 2, 9):
        panel.controls["step"].value = step
        left, right = shown(panel.output.value)
        same(left, expected(a, step))
        same(right, expected(b, step))
        assert left["counts"] == right["counts"]
    panel.controls["step"].value = 10  # the vLLM fixture ends at step 9: it shows its last step
    left, right = shown(panel.output.value)
    same(right, expected(b, 10))
    assert right["events"] == [] and "its trace ends at step 9" in panel.output.value
    assert left["counts"] == {"used": 0, "cached": 8, "free": 10}
    # a sequence has one colour in both panels
    colour = pool.colours(a, b)
    assert set(colour) == {"0", "1", "2.0", "2.1", "3"} and len(set(colour.values())) == 5


def test_without_a_front_end_it_shows_its_step_as_text():
    """nbval and a terminal see the bundle's text: the chosen step (or the first), not a widget's repr."""
    pytest.importorskip("ipywidgets")
    t = load(KVLIB)
    bundle = pool_explorer(KVLIB)._repr_mimebundle_()
    assert bundle["text/plain"] == step_text(t, 0)
    assert "used 2, cached 0, free 8" in bundle["text/plain"] and "allocate 0: blocks 0, 1" in bundle["text/plain"]
    assert "application/vnd.jupyter.widget-view+json" in bundle and "kv-pool-panel" in bundle["text/html"]
    chosen = pool_explorer(KVLIB, step=7)._repr_mimebundle_()["text/plain"]
    assert chosen.startswith("kvlib (hand-written fixture): step 7,") and "preempt 2.1" in chosen


def test_in_a_terminal_and_without_ipywidgets():
    code = ("import sys; sys.modules['ipywidgets'] = None\n"  # as if ipywidgets were not installed
            "from kvbook.pool import pool_explorer\n"
            f"v = pool_explorer({str(KVLIB)!r}, other={str(VLLM)!r}, step=3)\n"
            "print(type(v).__name__); print(repr(v)); print(sorted(v._repr_mimebundle_()))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("PoolView\nkvlib (hand-written fixture): step 3,") and "vllm (hand-written" in out
    assert "['text/html', 'text/plain']" in out
    ipython = subprocess.run([sys.executable, "-m", "IPython", "--quick", "--no-banner", "--colors=NoColor", "-c",
                              f"from kvbook.pool import pool_explorer; pool_explorer({str(KVLIB)!r})"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert ipython.returncode == 0 and ipython.stderr == "", ipython.stderr
    assert "used 2, cached 0, free 8" in ipython.stdout and "PoolExplorer(" not in ipython.stdout


def test_a_bad_step_or_trace_is_refused_before_drawing():
    with pytest.raises(IndexError, match="step 11 is outside the traces' steps, 0 to 10"):
        pool_explorer(KVLIB, step=11)
    with pytest.raises(TypeError, match="step must be an int, got str"):
        pool_explorer(KVLIB, step="3")
    bad = json.loads(KVLIB.read_text())
    bad["format"] = "vllm-events"
    with pytest.raises(ValueError, match="this explorer reads"):
        pool_explorer(KVLIB, other=bad)


def test_site_script_round_trips(tmp_path):
    path = pool.write(tmp_path / "pool-traces.js", {"kvlib": KVLIB, "vllm": load(VLLM)})
    body = path.read_text()
    code = [line for line in body.splitlines() if not line.startswith("//")]
    assert len(code) == 1 and code[0].startswith("window.kvPoolTraces = {")
    assert pool.read_script(body) == {"kvlib": load(KVLIB), "vllm": load(VLLM)}
    with pytest.raises(ValueError, match="one word"):
        pool.script({"two words": load(KVLIB)})
    with pytest.raises(ValueError, match=r"\.js"):
        pool.write(tmp_path / "traces.json", {"kvlib": KVLIB})
    record = tmp_path / "record.json"  # a record holding both, as vllmcheck stores them
    record.write_text(json.dumps({"kvlib": load(KVLIB), "vllm": load(VLLM), "checks": []}))
    path = pool.write(tmp_path / "both.js", {"a": f"{record}#vllm", "b": f"{record}#kvlib"})
    assert pool.read_script(path.read_text()) == {"a": load(VLLM), "b": load(KVLIB)}
    with pytest.raises(ValueError, match="holds no trace under 'sglang' \\(its keys: kvlib, vllm, checks\\)"):
        pool.source(f"{record}#sglang")
    run = subprocess.run([sys.executable, "-m", "kvbook.pool", str(tmp_path / "cli.js"), f"x={KVLIB}",
                          f"y={record}#vllm"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert pool.read_script((tmp_path / "cli.js").read_text()) == {"x": load(KVLIB), "y": load(VLLM)}
    broken = copy.deepcopy(load(KVLIB))
    broken["steps"][0]["tables"]["0"] = [0, 12]
    with pytest.raises(IndexError, match="block 12, but the pool has blocks 0 to 9"):
        pool.script({"kvlib": broken})


# -- the website's explorer, in Chromium -------------------------------------------------------------
# A copy of the built site (``make book``) with this worktree's scripts and the fixtures shipped
# as its traces, and a page made from chapter 9's with a pool explorer in place of its paging
# one. Opened from disk (file://), as a reader who opens _build/html/index.html does.

POOL_DIV = ('<div class="kv-explorer" data-explorer="pool" data-traces="{traces}" data-interval="120" '
            'role="group" aria-label="paged pool explorer">')
PANELS = """box => [...box.querySelectorAll('.kv-pool-panel')].map(p => {
  const rows = [...p.querySelectorAll('tr[data-seq]')];
  return {
    title: p.querySelector('.kv-pool-title').textContent,
    counts: Object.fromEntries(['used', 'cached', 'free'].map(k =>
      [k, Number(p.querySelector('output[data-name=' + k + ']').dataset.value)])),
    tables: Object.fromEntries(rows.map(r => [r.dataset.seq,
      r.querySelector('[data-name=table]').textContent.split(', ').map(Number)])),
    lengths: Object.fromEntries(rows.map(r => [r.dataset.seq, Number(r.querySelector('[data-name=length]').textContent)])),
    grid: [...p.querySelectorAll('g.kv-block')].map(g => [Number(g.dataset.block), g.dataset.kind,
      g.dataset.owners ? g.dataset.owners.split(' ') : [], Number(g.dataset.fill)]),
    labels: [...p.querySelectorAll('g.kv-block')].map(g => (g.querySelectorAll('text')[1] || {}).textContent || ''),
    events: [...p.querySelectorAll('.kv-pool-events li')].map(li => li.textContent),
  }; })"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    import shutil

    built = ROOT / "_build" / "html"
    if not (built / "book" / "ch09_paging.html").is_file():
        pytest.fail(f"{built} is not built: run `make book` (jupyter-book build) before the site tests")
    out = tmp_path_factory.mktemp("pool-site") / "html"
    shutil.copytree(built, out)
    for name in ("explorers.js", "explorers.css", "pool-explorer.js", "pool-explorer.css"):
        shutil.copy(ROOT / "js" / name, out / "_static" / name)
    pool.write(out / "_static" / "pool-traces.js", {"kvlib": KVLIB, "vllm": VLLM})
    page = (out / "book" / "ch09_paging.html").read_text(encoding="utf-8")
    if "pool-explorer.js" not in page:  # a site built before _config.yml loaded it
        page = re.sub(r'(<script src="../_static/explorers.js[^"]*"></script>)',
                      r'\1<script src="../_static/pool-explorer.js"></script>', page)
        page = re.sub(r'(<link rel="stylesheet" type="text/css" href="../_static/explorers.css[^"]*" />)',
                      r'\1<link rel="stylesheet" type="text/css" href="../_static/pool-explorer.css" />', page)
    paging = r'<div class="kv-explorer" data-explorer="paging"[^>]*>'
    for name, traces in (("pool", "kvlib vllm"), ("pool-one", "kvlib"), ("pool-none", "nosuch")):
        (out / "book" / f"{name}.html").write_text(re.sub(paging, POOL_DIV.format(traces=traces), page),
                                                   encoding="utf-8")
    return out


def open_pool(browser, site, name="pool", **kw):  # noqa: F811
    from test_explorers import open_explorer

    page, box, external, errors = open_explorer(browser, site.as_uri(), f"book/{name}", "pool", **kw)
    page.wait_for_function("b => b.dataset.pool", arg=box.element_handle(), timeout=10_000)
    return page, box, external, errors


def at_step(box, step: int) -> list[dict]:
    box.locator('input[type="range"]').fill(str(step))
    assert box.locator('output[data-name="step"]').get_attribute("data-value") == str(step)
    return box.evaluate(PANELS)


def agrees(js: dict, trace: dict, step: int) -> None:
    """What the page shows is the trace's record and kvbook's reading of it."""
    want, s = expected(trace, step), state_at(trace, step)
    assert js["counts"] == want["counts"], step
    assert js["tables"] == want["tables"] and js["lengths"] == want["lengths"], step
    assert [(b, sorted(o), f) for b, _, o, f in js["grid"]] == want["grid"], step
    kinds = {b: k for b, k, _, _ in js["grid"]}
    assert sorted(b for b, k in kinds.items() if k == "cached") == s["cached_blocks"], step
    assert js["events"] == [event_text(e) for e in s["events"]], step
    assert js["title"] == pool._title(trace, s), step
    assert js["labels"] == [pool._label(o) for _, _, o, _ in js["grid"]], step  # "2.1", or "×2" when shared


def clean(page, external, errors):
    assert external == [] and errors == [], (external, errors)
    requests = page.evaluate("performance.getEntriesByType('resource').map(e => e.name)")
    assert all(r.startswith("file://") for r in requests), [r for r in requests if not r.startswith("file:")]
    page.context.close()


def test_site_explorer_shows_the_python_reading(browser, site):  # noqa: F811
    """Side by side, at every step and past the shorter trace's end, from file://."""
    page, box, external, errors = open_pool(browser, site)
    assert box.get_attribute("data-pool") == "ready"
    a, b = load(KVLIB), load(VLLM)
    slider = box.locator('input[type="range"]')
    assert (slider.get_attribute("min"), slider.get_attribute("max")) == ("0", "10")
    for step in range(0, 11):
        left, right = at_step(box, step)
        agrees(left, a, step)
        agrees(right, b, step)
        assert [p for p in shown(pool.step_html(a, step, b))][0]["counts"] == left["counts"]
    clean(page, external, errors)


def test_site_explorer_checks_as_kvbook_does(browser, site):  # noqa: F811
    """The JavaScript's check refuses each bad trace with kvbook.pooltrace.check_trace's own words."""
    page, box, external, errors = open_pool(browser, site)
    for change, error, _ in BAD:
        t = json.loads(KVLIB.read_text())
        change(t)
        with pytest.raises(error) as e:
            check_trace(t)
        js = page.evaluate("t => { try { kvPool.checkTrace(t); return null; } catch (e) { return e.message; } }", t)
        assert js == str(e.value)
    ok = page.evaluate("t => kvPool.checkTrace(t) === t || 'not the trace'", load(KVLIB))
    assert ok is True
    clean(page, external, errors)


def test_site_explorer_plays(browser, site):  # noqa: F811
    page, box, external, errors = open_pool(browser, site)
    play = box.get_by_role("button", name="play", exact=True)
    play.click()
    assert play.get_attribute("aria-pressed") == "true"
    step = box.locator('output[data-name="step"]')
    page.wait_for_function("o => o.dataset.value === '10'", arg=step.element_handle(), timeout=10_000)
    page.wait_for_timeout(300)
    assert play.get_attribute("aria-pressed") == "false" and play.inner_text() == "▶ play"  # stopped at the end
    agrees(box.evaluate(PANELS)[0], load(KVLIB), 10)
    box.get_by_role("button", name="previous step").click()
    assert step.get_attribute("data-value") == "9"
    clean(page, external, errors)


def test_site_explorer_loads_a_readers_trace(browser, site, tmp_path):  # noqa: F811
    page, box, external, errors = open_pool(browser, site, "pool-none")
    error = box.locator('[data-name="error"]')
    assert box.get_attribute("data-pool") == "empty" and error.is_visible()
    assert "No trace named nosuch" in error.inner_text()
    files = box.locator('input[type="file"]')
    files.set_input_files([str(VLLM), str(KVLIB)])  # two files: side by side, in the order given
    page.wait_for_function("b => b.dataset.loaded", arg=box.element_handle())
    assert box.get_attribute("data-loaded") == "ok" and not error.is_visible()
    right, left = at_step(box, 6)[1], at_step(box, 6)[0]
    agrees(left, load(VLLM), 6)
    agrees(right, load(KVLIB), 6)
    assert "pool-trace-vllm.json and pool-trace-kvlib.json" in box.locator('[data-name="source"]').inner_text()
    bad = json.loads(KVLIB.read_text())
    bad["steps"][3]["tables"]["2.1"] = [3, 4, 10]
    (tmp_path / "mine.json").write_text(json.dumps(bad))
    (tmp_path / "cut.json").write_text(KVLIB.read_text()[:500])
    for name, words in (("mine.json", "steps[3].tables[2.1][2] is block 10, but the pool has blocks 0 to 9"),
                        ("cut.json", "not JSON")):
        box.evaluate("b => { delete b.dataset.loaded; }")
        files.set_input_files(str(tmp_path / name))
        page.wait_for_function("b => b.dataset.loaded", arg=box.element_handle())
        assert box.get_attribute("data-loaded") == "error" and error.is_visible()
        assert error.inner_text().startswith(f"{name}: ") and words in error.inner_text()
        assert len(box.evaluate(PANELS)) == 2  # the traces shown before stay
    files.set_input_files(str(KVLIB))  # one file: one panel
    page.wait_for_function("b => !b.querySelector('[data-name=error]').textContent", arg=box.element_handle())
    [one] = at_step(box, 3)
    agrees(one, load(KVLIB), 3)
    clean(page, external, errors)
    page, box, external, errors = open_pool(browser, site)  # shipped traces shown, no error until a bad file
    error = box.locator('[data-name="error"]')
    assert not error.is_visible()
    box.locator('input[type="file"]').set_input_files(str(tmp_path / "mine.json"))
    page.wait_for_function("b => b.dataset.loaded", arg=box.element_handle())
    assert error.is_visible() and error.inner_text().startswith("mine.json: steps[3]")
    clean(page, external, errors)


@pytest.mark.parametrize("name", ["pool", "pool-one"])
def test_site_explorer_fits_a_phone(browser, site, name):  # noqa: F811
    """At 390 px nothing sticks out, at the busiest step; the controls are 44 px tap targets."""
    page, box, external, errors = open_pool(browser, site, name, width=390, height=844)
    at_step(box, 6)
    page.wait_for_timeout(200)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    inside = box.evaluate("""b => {
        const r = b.getBoundingClientRect(), out = [];
        if (b.scrollWidth > b.clientWidth) out.push('box scrolls: ' + b.scrollWidth + ' > ' + b.clientWidth);
        for (const e of b.querySelectorAll('*')) {
          const q = e.getBoundingClientRect();
          if (q.width && (q.left < r.left - 0.5 || q.right > r.right + 0.5))
            out.push(e.tagName + '.' + e.getAttribute('class') + ' ' + Math.round(q.left) + '..' + Math.round(q.right));
        }
        return out; }""")
    assert inside == [], inside[:5]
    small = box.locator("button, input").evaluate_all(
        "es => es.map(e => [e.type, e.getBoundingClientRect().height]).filter(([t, h]) => h < 44)")
    assert small == [], small
    clean(page, external, errors)


@pytest.mark.parametrize("theme", ["dark", "light"])
def test_site_explorer_is_legible_in_both_themes(browser, site, theme):  # noqa: F811
    from test_explorers import CONTRAST

    page, box, external, errors = open_pool(browser, site, theme=theme)
    at_step(box, 4)
    result = box.evaluate(CONTRAST)
    assert result["n"] > 10 and result["bad"] == [], result["bad"][:6]
    from test_site import SHOTS

    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / f"explorer-pool-{theme}.png"))
    clean(page, external, errors)
