// The book's explorers, live in the reader's browser: no kernel, no network.
//
// A page asks for one with <div class="kv-explorer" data-explorer="cache|step|paging">.
// Every number starts from explorers-data.json, which `python -m kvlib.book.web` writes at
// build time from kvlib's own presets and tables. This file holds only the few
// formulas, and each one names the kvlib function it mirrors; the browser test
// (tests/test_explorers.py) checks them against kvlib on a grid of settings.
(function () {
  "use strict";

  // -- the formulas --------------------------------------------------------------------------------
  // kvlib.memory.kv_cache_bytes
  function kvCacheBytes(m, seqLen, batch, width) {
    return 2 * m.n_layer * batch * m.n_kv_head * seqLen * m.head_dim * width;
  }
  // kvlib.memory.layer_matrix_params
  function layerMatrixParams(m) {
    const d = m.d_model, H = m.n_head, Hkv = m.n_kv_head, D = m.head_dim, ff = m.d_ff;
    return d * (H + 2 * Hkv) * D + H * D * d + d * 2 * ff + ff * d;
  }
  // kvlib.memory.matrix_params
  function matrixParams(m, lmHead) {
    return m.n_layer * layerMatrixParams(m) + (lmHead ? m.d_model * m.vocab_size : 0);
  }
  // kvlib.memory.param_count (Llama family)
  function paramCount(m) {
    const norms = (2 * m.n_layer + 1) * m.d_model;
    return matrixParams(m, true) + norms + (m.tie_embeddings ? 0 : m.vocab_size * m.d_model);
  }
  // kvlib.cost.step_bytes and kvlib.cost.step_flops, for one decode step (new_tokens = 1)
  function stepBytes(m, batch, context, width) {
    const weights = matrixParams(m, true) + (2 * m.n_layer + 1) * m.d_model;
    const rows = m.tie_embeddings ? 0 : batch * m.d_model;
    return {
      weights: (weights + rows) * width,
      kv_read: kvCacheBytes(m, context, batch, width),
      kv_write: kvCacheBytes(m, 1, batch, width),
    };
  }
  function stepFlops(m, batch, context) {
    const body = 2 * matrixParams(m, false), head = 2 * m.d_model * m.vocab_size;
    return {
      matmul: batch * (body + head),
      attention: batch * 4 * m.n_layer * m.n_head * m.head_dim * (context + 1),
    };
  }
  // kvlib.hardware.step_time on a spec-sheet Hardware (no measured overhead or kernels)
  function stepTime(m, hw, batch, context, dtype, widths) {
    const width = widths[dtype], peak = hw.peak_flops[dtype], bw = hw.mem_bandwidth;
    const b = stepBytes(m, batch, context, width), f = stepFlops(m, batch, context);
    const matmulRate = Math.min(peak, (2 * batch / width) * bw);  // Hardware.matmul_flops
    const matmul = Math.max(f.matmul / matmulRate, b.weights / bw);
    const attention = Math.max((b.kv_read + b.kv_write) / bw, f.attention / peak);
    const bytes = b.weights + b.kv_read + b.kv_write, flops = f.matmul + f.attention;
    return { total: matmul + attention, bytes: bytes, weights: b.weights, flops: flops,
             kv: b.kv_read + b.kv_write, intensity: flops / bytes, ridge: peak / bw };
  }

  // -- small helpers -------------------------------------------------------------------------------
  function size(n) {  // as kvlib.book.explorer._size: binary units
    const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, scale] of units) if (n >= scale) return (n / scale).toFixed(2) + " " + unit;
    return n.toFixed(0) + " B";
  }
  function sig3(x) { return Number(x.toPrecision(3)); }
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  let uid = 0;
  function control(form, label, options, value) {  // a labelled <select>
    const id = "kv-ctl-" + (++uid);
    const wrap = el("div", { class: "kv-control" });
    wrap.append(el("label", { for: id }, label));
    const select = el("select", { id: id, name: label });
    setOptions(select, options, value);
    wrap.append(select);
    form.append(wrap);
    return select;
  }
  function setOptions(select, options, value) {
    select.replaceChildren(...options.map(([v, text]) => el("option", { value: String(v) }, text)));
    select.value = String(value);
  }
  function output(box, name, label) {  // <p>label: <output data-name data-value></output></p>
    const p = el("p", {}, label + ": ");
    const o = el("output", { "data-name": name, "aria-live": "polite" });
    p.append(o);
    box.append(p);
    return o;
  }
  function show(o, value, text) { o.dataset.value = String(value); o.textContent = text; }
  function bars(items, max, label) {  // horizontal bars as SVG, with a text equivalent
    const w = 520, left = 120, row = 26, h = row * items.length + 6;
    const svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="' + w + '" height="' + h +
                 '" role="img" aria-label="' + label + '">'];
    items.forEach(([name, v, color, text], i) => {
      const y = 4 + i * row, len = max > 0 ? (w - left - 90) * v / max : 0;
      svg.push('<text x="' + (left - 6) + '" y="' + (y + 15) + '" text-anchor="end" font-size="12">' +
               name + "</text>");
      svg.push('<rect x="' + left + '" y="' + y + '" width="' + len.toFixed(1) +
               '" height="18" fill="' + color + '"/>');
      svg.push('<text x="' + (left + len + 6).toFixed(1) + '" y="' + (y + 15) + '" font-size="12">' +
               text + "</text>");
    });
    return svg.join("") + "</svg>";
  }
  const BLUE = "#0072B2", RED = "#D55E00", GREY = "#7F7F7F", GREEN = "#009E73";
  function roofline(t, peak, bw, label) {  // log-log: FLOP/s = min(peak, intensity x bandwidth)
    const w = 360, h = 200, pad = 36, lo = -1, hi = 4;  // intensity 0.1 ... 10^4 FLOPs/byte
    const yHi = Math.log10(peak) + 0.3, yLo = yHi - 5;
    const X = i => pad + (w - pad - 8) * (Math.log10(i) - lo) / (hi - lo);
    const Y = f => h - pad + (pad + 8 - h) * (Math.log10(f) - yLo) / (yHi - yLo);
    const roof = [];
    for (let e = lo; e <= hi + 1e-9; e += 0.05) {
      const i = 10 ** e;
      roof.push(X(i).toFixed(1) + "," + Y(Math.min(peak, i * bw)).toFixed(1));
    }
    const px = X(Math.min(Math.max(t.intensity, 10 ** lo), 10 ** hi));
    const py = Y(Math.min(peak, t.intensity * bw));
    return '<svg xmlns="http://www.w3.org/2000/svg" width="' + w + '" height="' + h +
      '" role="img" aria-label="' + label + '">' +
      '<path d="M' + pad + ' 8 V' + (h - pad) + ' H' + (w - 8) + '" fill="none" stroke="#333"/>' +
      '<polyline fill="none" stroke="' + GREY + '" stroke-width="2" points="' + roof.join(" ") + '"/>' +
      '<circle cx="' + px.toFixed(1) + '" cy="' + py.toFixed(1) + '" r="5" fill="' + RED + '"/>' +
      '<text x="' + (w / 2) + '" y="' + (h - 6) + '" text-anchor="middle" font-size="11">' +
      "FLOPs per byte (log scale)</text>" +
      '<text x="10" y="' + (h / 2) + '" font-size="11" transform="rotate(-90 10 ' + (h / 2) +
      ')" text-anchor="middle">FLOP/s (log)</text></svg>';
  }

  // -- the three explorers -------------------------------------------------------------------------
  function cacheExplorer(box, data) {  // mirrors kvlib.book.explorer.cache_report
    const form = el("form", { class: "kv-controls" });
    const models = Object.entries(data.models).map(([k, m]) => [k, m.name]);
    const model = control(form, "model", models, "llama-2-7b");
    const dtype = control(form, "cache dtype", Object.keys(data.dtype_bytes).map(k => [k, k]), "fp16");
    const batch = control(form, "batch", [1, 2, 4, 8, 16, 32, 64, 128, 256].map(b => [b, b]), 8);
    const ctx = control(form, "context", data.contexts.map(c => [c, c.toLocaleString("en")]), 4096);
    const heads = control(form, "KV heads", [], 0);
    const gpu = control(form, "GPU memory", data.gpus_gib.map(g => [g, g + " GiB"]), 80);
    const out = el("div", { class: "kv-outputs" });
    const formula = el("p", { "data-name": "formula" });
    out.append(formula);
    const cache = output(out, "cache_bytes", "KV cache");
    const weights = output(out, "weight_bytes", "weights (fp16)");
    const fits = output(out, "fits", "weights + cache");
    const figure = el("div", { class: "kv-figure" });
    out.append(figure);
    box.append(form, out);
    function refillHeads() {
      const m = data.models[model.value];
      setOptions(heads, m.kv_heads.map(h => [h, h]), m.n_kv_head);
    }
    function refresh() {
      const m = Object.assign({}, data.models[model.value], { n_kv_head: Number(heads.value) });
      const width = data.dtype_bytes[dtype.value], b = Number(batch.value), s = Number(ctx.value);
      const c = kvCacheBytes(m, s, b, width);
      const w = paramCount(m) * data.dtype_bytes.fp16;  // cache_report's weight_dtype="fp16"
      const g = Number(gpu.value) * data.gib;
      formula.textContent = "2 × " + m.n_layer + " layers × " + b + " sequences × " + m.n_kv_head +
        " KV heads × " + s + " tokens × " + m.head_dim + " dims × " + width + " bytes";
      show(cache, c, size(c) + " (" + c.toLocaleString("en") + " bytes), " +
           (c / w).toFixed(2) + "× the weights");
      show(weights, w, size(w));
      const ok = w + c <= g;
      show(fits, ok, size(w + c) + ", which " + (ok ? "fits" : "does not fit") + " in " + size(g));
      figure.innerHTML = bars([["weights", w, BLUE, size(w)], ["KV cache", c, RED, size(c)],
                               ["GPU memory", g, GREY, size(g)]], Math.max(w, c, g),
                              "weights " + size(w) + ", KV cache " + size(c) + ", GPU " + size(g));
    }
    model.addEventListener("change", () => { refillHeads(); refresh(); });
    for (const s of [dtype, batch, ctx, heads, gpu]) s.addEventListener("change", refresh);
    refillHeads();
    refresh();
  }

  function stepExplorer(box, data) {  // mirrors kvlib.hardware.step_time
    const form = el("form", { class: "kv-controls" });
    const hwNames = Object.entries(data.hardware).map(([k, h]) => [k, h.name]);
    const hw = control(form, "hardware", hwNames, "h100");
    const model = control(form, "model", Object.entries(data.models).map(([k, m]) => [k, m.name]),
                          "llama-3-8b");
    const dtype = control(form, "dtype", [], "bf16");
    const batch = control(form, "batch", [1, 2, 4, 8, 16, 32, 64, 128, 256].map(b => [b, b]), 1);
    const ctx = control(form, "context", data.contexts.map(c => [c, c.toLocaleString("en")]), 4096);
    const out = el("div", { class: "kv-outputs" });
    const time = output(out, "step_seconds", "predicted decode step");
    const rate = output(out, "tokens_per_s", "tokens per second (the whole batch)");
    const share = output(out, "kv_share", "share of the step's bytes that is KV cache");
    const bound = output(out, "bound", "intensity against the ridge");
    const figure = el("div", { class: "kv-figure" });
    out.append(figure);
    box.append(form, out);
    function refillDtypes() {
      const listed = data.step_dtypes.filter(d => d in data.hardware[hw.value].peak_flops);
      const want = dtype.value || "bf16";  // keep the reader's choice where this hardware has it
      const keep = listed.includes(want) ? want : listed.includes("fp16") ? "fp16" : listed[0];
      setOptions(dtype, listed.map(d => [d, d]), keep);
    }
    function refresh() {
      const h = data.hardware[hw.value], m = data.models[model.value];
      const b = Number(batch.value), s = Number(ctx.value);
      const t = stepTime(m, h, b, s, dtype.value, data.dtype_bytes);
      show(time, t.total, sig3(1e3 * t.total) + " ms");
      show(rate, b / t.total, sig3(b / t.total).toLocaleString("en") + " tokens/s");
      show(share, t.kv / t.bytes, (100 * t.kv / t.bytes).toFixed(1) + "% (weights " +
           (100 * t.weights / t.bytes).toFixed(1) + "%)");
      const mem = t.intensity < t.ridge;
      show(bound, mem ? "memory" : "compute", sig3(t.intensity) + " FLOPs/byte against a ridge of " +
           sig3(t.ridge) + ": " + (mem ? "memory-bound" : "compute-bound"));
      figure.innerHTML = bars([["weights", t.weights, BLUE, size(t.weights)],
                               ["KV cache", t.kv, RED, size(t.kv)]], Math.max(t.weights, t.kv),
                              "bytes per step: weights " + size(t.weights) + ", KV cache " + size(t.kv)) +
        roofline(t, h.peak_flops[dtype.value], h.mem_bandwidth,
                 "roofline of " + h.name + ": the step at " + sig3(t.intensity) +
                 " FLOPs per byte, " + (mem ? "under the sloped, memory-bound roof" : "under the flat, compute-bound roof"));
    }
    hw.addEventListener("change", () => { refillDtypes(); refresh(); });
    for (const c of [model, dtype, batch, ctx]) c.addEventListener("change", refresh);
    refillDtypes();
    refresh();
  }

  function pagingExplorer(box, data) {  // reads the table kvlib.book.web.paging_table simulated
    const p = data.paging;
    const form = el("form", { class: "kv-controls" });
    const block = control(form, "block size", p.blocks.map(b => [b, b]), 16);
    const maxLens = [...new Set(p.rows.map(r => r.max_len))];
    const medians = [...new Set(p.rows.map(r => r.median))];
    const maxLen = control(form, "context limit", maxLens.map(m => [m, m]), 2048);
    const median = control(form, "median request length", medians.map(m => [m, m]), 256);
    const out = el("div", { class: "kv-outputs" });
    const wMax = output(out, "waste_max", "waste, reserving the context limit");
    const wPow2 = output(out, "waste_pow2", "waste, reserving a power of two");
    const wPaged = output(out, "waste_paged", "waste, paged");
    const mean = output(out, "mean_len", "mean request length of this trace (prompt + output)");
    const figure = el("div", { class: "kv-figure" });
    out.append(el("p", {}, "Simulated by kvlib for " + p.requests + " requests and a pool of " +
                  p.pool.toLocaleString("en") + " token slots."), figure);
    box.append(form, out);
    function refresh() {
      const row = p.rows.find(r => r.max_len === Number(maxLen.value) &&
                                   r.median === Number(median.value));
      const paged = row.paged[block.value];
      const pct = x => (100 * x).toFixed(1) + "%";
      show(wMax, row.max, pct(row.max));
      show(wPow2, row.pow2, pct(row.pow2));
      show(wPaged, paged, pct(paged));
      show(mean, row.mean_len, row.mean_len.toFixed(0) + " tokens");
      figure.innerHTML = bars([["max", row.max, RED, pct(row.max)], ["pow2", row.pow2, GREY, pct(row.pow2)],
                               ["paged", paged, GREEN, pct(paged)]], 1,
                              "waste: max " + pct(row.max) + ", pow2 " + pct(row.pow2) +
                              ", paged " + pct(paged));
    }
    for (const c of [block, maxLen, median]) c.addEventListener("change", refresh);
    refresh();
  }

  const EXPLORERS = { cache: cacheExplorer, step: stepExplorer, paging: pagingExplorer };

  function start() {
    const boxes = document.querySelectorAll("div.kv-explorer[data-explorer]");
    if (!boxes.length) return;
    const root = document.documentElement.dataset.content_root || "./";
    fetch(root + "_static/explorers-data.json")
      .then(r => { if (!r.ok) throw new Error("explorers-data.json: HTTP " + r.status); return r.json(); })
      .then(data => boxes.forEach(box => {
        EXPLORERS[box.dataset.explorer](box, data);
        box.dataset.ready = "true";
      }))
      .catch(err => boxes.forEach(box => { box.textContent = "The explorer could not load: " + err; }));
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
