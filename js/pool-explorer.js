// The pool explorer: step through a trace of a paged pool, or two side by side, in the
// reader's browser (no kernel, no network).
//
// A page asks for it with <div class="kv-explorer" data-explorer="pool" data-traces="a b">:
// the names of traces in pool-traces.js, a script that `python -m kvbook.pool` writes at
// build time from recorded traces (format kv-pool-trace/1) and that sets window.kvPoolTraces.
// A script, not JSON to fetch, so a page opened from disk (file://) can load it. A reader
// may load a trace they recorded (one file, or two to compare), read with FileReader.
//
// It draws what kvbook.pool draws in a notebook, from the same reading of the trace:
// checkTrace mirrors kvbook.pooltrace.check_trace (same rules, same messages) and stateAt mirrors
// kvbook.pooltrace.state_at; tests/test_pool_explorer.py compares them in Chromium.
(function () {
  "use strict";

  const FORMAT = "kv-pool-trace/1";
  const COUNTS = ["used", "cached", "free"];
  const EVENT_FIELDS = { admit: ["seq"], hit: ["seq", "blocks"], allocate: ["seq", "blocks"],
                         seal: ["blocks"], cow: ["seq", "from", "to"], fork: ["seq", "parent", "blocks"],
                         evict: ["blocks"],
                         preempt: ["seq", "blocks"], free: ["seq", "blocks"] };
  // kvbook.pool.PALETTE and CACHED: Okabe-Ito without black, and grey for cached blocks
  const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442"];
  const CACHED = "#8C8C8C";
  const CELL = 40, GAP = 4, LABEL = 14, TANK = 26;

  // -- reading a trace: kvbook.pooltrace ---------------------------------------------------------
  class TraceError extends Error {}
  const fail = msg => { throw new TraceError(msg); };
  const show = x => (JSON.stringify(x) === undefined ? "undefined" : JSON.stringify(x)).slice(0, 60);
  const isObject = x => x !== null && typeof x === "object" && !Array.isArray(x);
  const has = (o, k) => Object.prototype.hasOwnProperty.call(o, k);
  function int(where, x, low) {  // kvbook.pooltrace._int
    low = low || 0;
    if (typeof x !== "number" || !Number.isInteger(x)) fail(where + " must be an integer, got " + show(x));
    if (x < low) fail(where + " must be at least " + low + ", got " + x);
    return x;
  }
  function field(o, k, where) {
    if (!has(o, k)) fail(where + " has no " + show(k) + " field");
    return o[k];
  }
  function block(where, b, n) {
    int(where, b);
    if (b >= n)
      fail(where + " is block " + b + ", but the pool has blocks 0 to " + (n - 1) + " (num_blocks " + n + ")");
    return b;
  }
  function blocks(where, bs, n) {
    if (!Array.isArray(bs)) fail(where + " must be a list of block ids, got " + show(bs));
    return bs.map((b, i) => block(where + "[" + i + "]", b, n));
  }
  function seq(where, s, requests) {  // a key the requests list: "3", or "3.1" for a sample of 3
    if (typeof s !== "string" || !has(requests, s))
      fail(where + " names sequence " + show(s) + ", which is not among the requests (" +
           (Object.keys(requests).sort(cmp).join(", ") || "none") + ")");
    return s;
  }
  function object(where, x) {
    if (!isObject(x)) fail(where + " must be an object, got " + show(x));
    return x;
  }
  function checkEvent(where, e, n, requests) {
    object(where, e);
    const kind = field(e, "kind", where);
    if (typeof kind !== "string") fail(where + ".kind must be a string, got " + show(kind));
    for (const key of (has(EVENT_FIELDS, kind) ? EVENT_FIELDS[kind] : [])) {  // unknown kinds: skipped
      const v = field(e, key, where + " (" + kind + ")");
      if (key === "seq" || key === "parent") seq(where + "." + key, v, requests);
      else if (key === "blocks") blocks(where + ".blocks", v, n);
      else block(where + "." + key, v, n);
    }
  }
  function checkStep(where, s, n, size, requests) {
    const events = field(s, "events", where);
    if (!Array.isArray(events)) fail(where + ".events must be a list, got " + show(events));
    events.forEach((e, i) => checkEvent(where + ".events[" + i + "]", e, n, requests));
    const tables = object(where + ".tables", field(s, "tables", where));
    const lengths = object(where + ".lengths", field(s, "lengths", where));
    for (const [k, table] of Object.entries(tables)) {
      seq(where + ".tables", k, requests);
      blocks(where + ".tables[" + k + "]", table, n);
    }
    const odd = Object.keys(lengths).filter(k => !has(tables, k))
      .concat(Object.keys(tables).filter(k => !has(lengths, k))).sort();
    if (odd.length)
      fail(where + ": lengths and tables must name the same sequences; only one of them names " + odd.join(", "));
    for (const [k, length] of Object.entries(lengths)) {
      int(where + ".lengths[" + k + "]", length);
      if (length > tables[k].length * size)
        fail(where + ".lengths[" + k + "] is " + length + " tokens, more than its " + tables[k].length +
             " blocks of " + size + " hold");
    }
    const counts = object(where + ".counts", field(s, "counts", where));
    const c = {};
    for (const k of COUNTS) c[k] = int(where + ".counts." + k, field(counts, k, where + ".counts"));
    if (c.used + c.free !== n) fail(where + ".counts: used " + c.used + " + free " + c.free + " must be num_blocks " + n);
    if (c.cached > c.free)
      fail(where + ".counts: cached " + c.cached + " must be at most free " + c.free +
           " (cached blocks are free blocks that still hold a prefix)");
    const held = new Set(Object.values(tables).flat()).size;
    if (held !== c.used)
      fail(where + ".counts: used is " + c.used + ", but the tables hold " + held + " distinct blocks");
  }
  function checkTrace(t) {  // kvbook.pooltrace.check_trace
    object("the trace", t);
    const fmt = field(t, "format", "the trace");
    if (fmt !== FORMAT) fail("the trace's format is " + show(fmt) + "; this explorer reads " + show(FORMAT));
    const n = int("num_blocks", field(t, "num_blocks", "the trace"), 1);
    const size = int("block_size", field(t, "block_size", "the trace"), 1);
    const requests = object("requests", field(t, "requests", "the trace"));
    const steps = field(t, "steps", "the trace");
    if (!Array.isArray(steps) || !steps.length) fail("steps must be a non-empty list, got " + show(steps));
    let last = -1;
    steps.forEach((s, i) => {
      const where = "steps[" + i + "]";
      const number = int(where + ".step", field(object(where, s), "step", where));
      if (number <= last) fail(where + ".step is " + number + ", not after the step before it (" + last + ")");
      last = number;
      checkStep(where, s, n, size, requests);
    });
    return t;
  }
  // kvbook.pooltrace.seq_key: by request id, then sample, numbers as numbers
  function seqKey(s) { return s.split(".").map(p => /^[0-9]+$/.test(p) ? [0, Number(p), ""] : [1, 0, p]); }
  function cmp(a, b) {
    const x = seqKey(a), y = seqKey(b);
    for (let i = 0; i < Math.min(x.length, y.length); i++)
      for (let j = 0; j < 3; j++) if (x[i][j] !== y[i][j]) return x[i][j] < y[i][j] ? -1 : 1;
    return x.length - y.length;
  }
  function stepRange(traces) {  // kvbook.pooltrace.step_range
    return [Math.min(...traces.map(t => t.steps[0].step)),
            Math.max(...traces.map(t => t.steps[t.steps.length - 1].step))];
  }
  function stateAt(trace, step) {  // kvbook.pooltrace.state_at
    const n = trace.num_blocks, size = trace.block_size, sealed = new Set();
    let current = null;
    for (const s of trace.steps) {
      if (s.step > step) break;
      current = s;
      for (const e of s.events) {
        if (e.kind === "seal") e.blocks.forEach(b => sealed.add(b));
        else if (e.kind === "evict") e.blocks.forEach(b => sealed.delete(b));
      }
    }
    const tables = {}, owners = new Map(), fill = new Map();
    let lengths = {}, counts = { used: 0, cached: 0, free: n }, events = [];
    if (current) {
      for (const k of Object.keys(current.tables).sort(cmp)) tables[k] = current.tables[k];
      lengths = current.lengths; counts = current.counts;
      events = current.step === step ? current.events : [];
    }
    const order = Object.keys(current ? current.tables : {}).sort(cmp);
    for (const k of order) tables[k].forEach((b, j) => {
      if (!owners.has(b)) owners.set(b, []);
      owners.get(b).push(k);
      fill.set(b, Math.max(fill.get(b) || 0, Math.min(size, Math.max(0, lengths[k] - j * size))));
    });
    const cached = [...sealed].filter(b => !owners.has(b)).sort((a, b) => a - b);
    return { step: step, at: current ? current.step : null, events: events, tables: tables, order: order,
             lengths: lengths, counts: counts, owners: owners, fill: fill, cached_blocks: cached };
  }

  // -- drawing: kvbook.pool ----------------------------------------------------------------------
  function colours(traces) {  // kvbook.pool.colours
    const seen = [];
    for (const t of traces) for (const s of t.steps)
      for (const k of Object.keys(s.tables).sort(cmp)) if (!seen.includes(k)) seen.push(k);
    const out = {};
    seen.forEach((k, i) => { out[k] = PALETTE[i % PALETTE.length]; });
    return out;
  }
  const ids = bs => (bs.length === 1 ? "block " : "blocks ") + bs.join(", ");
  function eventText(e) {  // kvbook.pool.event_text
    const k = e.kind;
    if (k === "admit")
      return "admit " + e.seq + (e.cached_tokens == null ? "" : " (" + e.cached_tokens + " tokens cached)");
    if (k === "hit") return "prefix hit " + e.seq + ": reuses " + ids(e.blocks);
    if (k === "allocate" || k === "free") return k + " " + e.seq + ": " + ids(e.blocks);
    if (k === "seal") return "seal " + ids(e.blocks) + " (full: its prefix can be reused)";
    if (k === "fork") return "fork " + e.seq + " from " + e.parent + ": shares " + ids(e.blocks);
    if (k === "cow") return "copy-on-write " + e.seq + ": block " + e.from + " → " + e.to;
    if (k === "evict") return "evict " + ids(e.blocks) + " (its cached prefix dropped)";
    if (k === "preempt") return "preempt " + e.seq + ": gives back " + ids(e.blocks);
    return k + " (not drawn)";
  }
  function title(trace, s) {  // kvbook.pool._title
    const at = s.at, last = trace.steps[trace.steps.length - 1].step;
    const where = at === null ? " (before its first step)" : at === s.step ? "" :
      at === last ? " (its trace ends at step " + at + ")" : " (none recorded: as at step " + at + ")";
    return (trace.engine || "an engine") + ": step " + s.step + where + ", " + trace.num_blocks +
      " blocks of " + trace.block_size + " tokens";
  }
  function esc(s) { return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/"/g, "&quot;"); }
  function label(own) {  // kvbook.pool._label: the owner, cut to 4 characters, or "×2" when shared
    if (own.length > 1) return "×" + own.length;
    return !own.length ? "" : [...own[0]].length <= 4 ? own[0] : [...own[0]].slice(0, 3).join("") + "…";
  }
  function gridSvg(trace, s, palette, width) {  // kvbook.pool.grid_svg
    const size = trace.block_size, cols = Math.max(1, Math.min(16, Math.floor((width + GAP) / (CELL + GAP))));
    const rows = Math.ceil(trace.num_blocks / cols);
    const w = cols * (CELL + GAP) - GAP, h = rows * (LABEL + TANK + GAP);
    const cached = new Set(s.cached_blocks);
    const svg = ['<svg xmlns="http://www.w3.org/2000/svg" class="kv-svg kv-pool-grid" width="' + w + '" height="' + h +
      '" viewBox="0 0 ' + w + " " + h + '" role="img" aria-label="pool of ' + trace.num_blocks + " blocks at step " +
      s.step + ": " + s.counts.used + " used, " + s.counts.cached + ' cached">'];
    for (let b = 0; b < trace.num_blocks; b++) {
      const own = s.owners.get(b) || [], f = s.fill.get(b) || 0;
      const kind = own.length ? "used" : cached.has(b) ? "cached" : "free";
      const x = (b % cols) * (CELL + GAP), y = Math.floor(b / cols) * (LABEL + TANK + GAP), ty = y + LABEL;
      const owner = label(own);
      const tip = "block " + b + ": " + (own.length ? own.join(", ") + ", " + f + " of " + size + " tokens" : kind);
      svg.push('<g class="kv-block" data-block="' + b + '" data-kind="' + kind + '" data-owners="' + esc(own.join(" ")) +
               '" data-fill="' + f + '"><title>' + esc(tip) + "</title>");
      svg.push('<text class="kv-block-id" x="' + x + '" y="' + (y + 10) + '" font-size="9" fill="currentColor">' +
               b + "</text>");
      if (owner) svg.push('<text x="' + (x + CELL) + '" y="' + (y + 10) + '" font-size="10" font-weight="600" ' +
                          'text-anchor="end" fill="currentColor">' + esc(owner) + "</text>");
      const box = 'x="' + (x + 0.5) + '" y="' + (ty + 0.5) + '" width="' + (CELL - 1) + '" height="' + (TANK - 1) + '"';
      if (kind === "used") {
        const c = palette[own[0]] || CACHED, part = TANK * f / size;
        svg.push("<rect " + box + ' fill="' + c + '" fill-opacity="0.18" stroke="' + c + '" stroke-width="' +
                 (own.length > 1 ? 2.5 : 1) + '"/>');
        svg.push('<rect x="' + (x + 0.5) + '" y="' + (ty + TANK - part).toFixed(1) + '" width="' + (CELL - 1) +
                 '" height="' + part.toFixed(1) + '" fill="' + c + '"/>');
      } else if (kind === "cached") {
        svg.push("<rect " + box + ' fill="' + CACHED + '" fill-opacity="0.45" stroke="' + CACHED + '"/>');
      } else {
        svg.push("<rect " + box + ' fill="none" stroke="' + CACHED + '" stroke-dasharray="3 2"/>');
      }
      svg.push("</g>");
    }
    return svg.join("") + "</svg>";
  }

  // -- the explorer ------------------------------------------------------------------------------
  // explorers.js's element maker (window.kvExplorerKit), which loads first and calls poolExplorer
  const el = (tag, attrs, text) => window.kvExplorerKit.el(tag, attrs, text);
  let uid = 0;

  function panel(trace, step, palette) {
    const s = stateAt(trace, step), p = el("section", { class: "kv-pool-panel" });
    p.append(el("p", { class: "kv-pool-title" }, title(trace, s)));
    const counts = el("p", { class: "kv-pool-counts" });
    COUNTS.forEach((k, i) => {
      if (i) counts.append(" · ");
      counts.append(k + " ");
      counts.append(el("output", { "data-name": k, "data-value": String(s.counts[k]) }, String(s.counts[k])));
    });
    p.append(counts);
    const pic = el("div", { class: "kv-picture" });
    p.draw = () => {  // at the picture's width, once the panel is laid out
      pic.innerHTML = gridSvg(trace, s, palette, Math.max(120, Math.min(pic.clientWidth || 320, 700)));
    };
    p.append(pic);
    if (s.cached_blocks.length !== s.counts.cached)
      p.append(el("p", { class: "kv-note" }, "The events mark " + s.cached_blocks.length +
                                            " blocks cached; the engine counts " + s.counts.cached + "."));
    if (s.order.length) {
      const table = el("table", { class: "kv-pool-tables" });
      const head = el("tr");
      for (const h of ["sequence", "block table", "tokens"]) head.append(el("th", { scope: "col" }, h));
      table.append(el("caption", {}, "Block tables"), head);
      for (const k of s.order) {
        const row = el("tr", { "data-seq": k });
        const name = el("td");
        const swatch = el("span", { class: "kv-swatch", "aria-hidden": "true" });
        swatch.style.background = palette[k] || CACHED;
        name.append(swatch, k);
        row.append(name, el("td", { "data-name": "table" }, s.tables[k].join(", ")),
                   el("td", { "data-name": "length" }, String(s.lengths[k])));
        table.append(row);
      }
      p.append(table);
    } else {
      p.append(el("p", { class: "kv-note", "data-name": "no-tables" }, "No sequence holds a block."));
    }
    p.append(el("p", { class: "kv-pool-head" }, "Events at this step"));
    if (s.events.length) {
      const list = el("ol", { class: "kv-pool-events" });
      for (const e of s.events) list.append(el("li", {}, eventText(e)));
      p.append(list);
    } else p.append(el("p", { class: "kv-note" }, "No block events at this step."));
    return p;
  }

  function legend() {
    const p = el("p", { class: "kv-legend" });
    const key = (html, text) => { const s = el("span", { class: "kv-key" });
      s.innerHTML = '<svg width="18" height="12" aria-hidden="true">' + html + "</svg>"; s.append(" " + text); p.append(s); };
    key('<rect x="1" y="1" width="16" height="10" fill="' + PALETTE[0] + '" fill-opacity="0.18" stroke="' + PALETTE[0] +
        '"/><rect x="1" y="6" width="16" height="5" fill="' + PALETTE[0] + '"/>', "held by a sequence, coloured up to its fill");
    key('<rect x="1" y="1" width="16" height="10" fill="' + CACHED + '" fill-opacity="0.45" stroke="' + CACHED + '"/>',
        "cached: free, its prefix kept");
    key('<rect x="1" y="1" width="16" height="10" fill="none" stroke="' + CACHED + '" stroke-dasharray="3 2"/>', "free");
    return p;
  }

  function poolExplorer(box) {
    const form = el("div", { class: "kv-pool-controls" });
    const play = el("button", { type: "button", class: "kv-button", "aria-label": "play", "aria-pressed": "false" },
                    "▶ play");
    const prev = el("button", { type: "button", class: "kv-button", "aria-label": "previous step" }, "‹");
    const next = el("button", { type: "button", class: "kv-button", "aria-label": "next step" }, "›");
    const id = "kv-pool-step-" + (++uid);
    const label = el("label", { for: id }, "step");
    const slider = el("input", { type: "range", id: id, name: "step", min: "0", max: "0", value: "0" });
    const now = el("output", { "data-name": "step", for: id });
    form.append(play, prev, next, label, slider, now);
    const fileId = "kv-pool-file-" + uid;
    const load = el("p", { class: "kv-pool-load" });
    const file = el("input", { type: "file", id: fileId, accept: ".json,application/json", multiple: "" });
    load.append(el("label", { for: fileId }, "Load a trace you recorded (one JSON file, or two side by side)"), file);
    const error = el("p", { class: "kv-warning", "data-name": "error", role: "alert", hidden: "" });
    const about = el("p", { class: "kv-note", "data-name": "source" });
    const panels = el("div", { class: "kv-pool" });
    box.append(form, about, error, panels, legend(), load);
    let traces = [], timer = null;

    function draw() {
      const step = Number(slider.value);
      now.value = String(step);
      now.dataset.value = String(step);
      const palette = colours(traces);
      const list = traces.map((t, i) => {
        const p = panel(t, step, palette);
        p.dataset.trace = String(i);
        return p;
      });
      panels.replaceChildren(...list);
      list.forEach(p => p.draw());  // the grid at its panel's width, once the panel is laid out
    }
    function use(list, source) {
      traces = list;
      const [lo, hi] = stepRange(traces);
      slider.min = String(lo); slider.max = String(hi); slider.value = String(lo);
      about.textContent = source;
      stop();
      draw();
    }
    function stop() {
      if (timer) clearInterval(timer);
      timer = null;
      play.textContent = "▶ play";
      play.setAttribute("aria-pressed", "false");
    }
    function go(delta) { slider.value = String(Number(slider.value) + delta); draw(); }
    play.addEventListener("click", () => {
      if (timer) { stop(); return; }
      if (Number(slider.value) >= Number(slider.max)) slider.value = slider.min;
      play.textContent = "❚❚ pause"; play.setAttribute("aria-pressed", "true");
      timer = setInterval(() => { if (Number(slider.value) >= Number(slider.max)) stop(); else go(1); },
                          Number(box.dataset.interval || 800));
    });
    prev.addEventListener("click", () => { stop(); go(-1); });
    next.addEventListener("click", () => { stop(); go(1); });
    slider.addEventListener("input", () => { stop(); draw(); });
    file.addEventListener("change", () => {
      const files = [...file.files].slice(0, 2);
      if (!files.length) return;
      Promise.all(files.map(f => new Promise(resolve => {
        const reader = new FileReader();
        reader.onload = () => {
          try { resolve(checkTrace(JSON.parse(reader.result))); }
          catch (e) { resolve(new Error(f.name + ": " + (e instanceof TraceError ? "" : "not JSON: ") + e.message)); }
        };
        reader.onerror = () => resolve(new Error(f.name + ": could not be read"));
        reader.readAsText(f);
      }))).then(list => {
        const bad = list.filter(x => x instanceof Error);
        error.textContent = bad.map(e => e.message).join(" ");
        error.hidden = !bad.length;
        if (!bad.length)
          use(list, "Your trace" + (list.length > 1 ? "s: " : ": ") + files.map(f => f.name).join(" and "));
        box.dataset.loaded = bad.length ? "error" : "ok";
      });
    });

    const shipped = () => {
      const all = window.kvPoolTraces || {}, names = (box.dataset.traces || "").split(/\s+/).filter(Boolean);
      const want = names.length ? names : Object.keys(all).slice(0, 2);
      const missing = want.filter(k => !has(all, k));
      if (!want.length || missing.length) {
        error.textContent = (want.length ? "No trace named " + missing.join(", ") + " was shipped with this page."
                                         : "No trace was shipped with this page.") + " Load one you recorded below.";
        error.hidden = false;
        box.dataset.pool = "empty";
        return;
      }
      use(want.map(k => all[k]), "Recorded at build time: " + want.map(k => all[k].engine || k).join(" and "));
      box.dataset.pool = "ready";
    };
    if (window.kvPoolTraces) shipped();
    else {  // pool-traces.js, beside explorers-data.js: a script, so file:// works
      const root = document.documentElement.dataset.content_root || "./";
      const script = el("script", { src: root + "_static/pool-traces.js" });
      script.onload = shipped;
      script.onerror = shipped;
      document.head.append(script);
    }
    if (typeof ResizeObserver !== "undefined") {
      let last = box.clientWidth;
      new ResizeObserver(() => {
        if (box.clientWidth !== last && traces.length) { last = box.clientWidth; draw(); }
      }).observe(box);
    }
  }

  window.kvExplorers = Object.assign(window.kvExplorers || {}, { pool: poolExplorer });
  window.kvPool = { checkTrace: checkTrace, stateAt: stateAt, eventText: eventText, colours: colours };
})();
