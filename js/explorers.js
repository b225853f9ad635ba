// The book's explorers, live in the reader's browser: no kernel, no network.
//
// A page asks for one with <div class="kv-explorer" data-explorer="cache|step|paging|masks|quant|
// speculate">.
// Every number starts from explorers-data.js, which `python -m kvbook.web` writes at
// build time from kvlib's own presets and tables. This file holds only the few
// formulas, and each one names the kvlib function it mirrors; the browser test
// (tests/test_explorers.py) checks them against kvlib on a grid of settings.
//
// Pictures are SVG drawn at the width of their box (and redrawn when it changes), in
// the theme's colours (currentColor and the theme's CSS variables), so they fit a
// phone and read in dark mode as in light.
(function () {
  "use strict";

  // -- the formulas --------------------------------------------------------------------------------
  // kvlib.layers.tokens_held: what one layer stores after a text of n tokens
  function tokensHeld(k, n) {
    if (k.kind === "full" || k.kind === "latent") return n;
    if (k.kind === "shared") return 0;
    if (k.kind === "window") return Math.min(n, k.size + k.sinks);
    return n === 0 ? 0 : (n - 1) % k.size + 1;  // chunked: the last chunk's tokens
  }
  // kvlib.memory.numbers_per_token: K and V per KV head, one latent of r, or nothing (shared)
  function numbersPerToken(m, k) {
    if (k.kind === "shared") return 0;
    if (k.kind === "latent") return k.size;
    return 2 * m.n_kv_head * m.head_dim;
  }
  // kvlib.memory.kv_cache_bytes: the sum over layers of kvlib.memory.kv_bytes_by_layer
  function kvCacheBytes(m, seqLen, batch, width) {
    let total = 0;
    for (const k of m.layers) total += batch * numbersPerToken(m, k) * tokensHeld(k, seqLen) * width;
    return total;
  }
  // kvlib.layers.LayerKind.__str__: "full", "window(512)", "window(8, sinks=4)", "shared(3)"
  function kindName(k) {
    if (k.kind === "full") return "full";
    if (k.kind === "shared") return "shared(" + k.source + ")";
    return k.kind + "(" + k.size + (k.sinks ? ", sinks=" + k.sinks : "") + ")";
  }
  // kvbook.explorer.cache_terms: one term of the formula per kind of layer
  function cacheTerms(m, seqLen, batch, width) {
    const terms = new Map();
    for (const k of m.layers) {
      const name = kindName(k);
      if (!terms.has(name)) terms.set(name, { kind: name, layers: 0, tokens: tokensHeld(k, seqLen),
                                              numbers: numbersPerToken(m, k), bytes: 0 });
      const t = terms.get(name);
      t.layers += 1;
      t.bytes += batch * t.numbers * t.tokens * width;
    }
    return [...terms.values()];
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
  // kvlib.memory.weight_bytes + kvlib.memory.kv_cache_bytes: what must sit in the GPU's
  // memory for `batch` sequences of `context` tokens, weights and cache at one width
  function memoryBytes(m, batch, context, width) {
    const weights = m.param_count * width, cache = kvCacheBytes(m, context, batch, width);
    return { weights: weights, cache: cache, total: weights + cache };
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

  // -- numbers as text -----------------------------------------------------------------------------
  // Thousands separators everywhere, as the chapters print numbers: 4,096 tokens.
  function sep(x, digits) {
    return x.toLocaleString("en", { maximumFractionDigits: digits || 0,
                                    minimumFractionDigits: digits || 0 });
  }
  function size(n) {  // as kvbook.explorer._size: binary units (chapter 4 counts in GiB)
    const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, scale] of units) if (n >= scale) return sep(n / scale, 2) + " " + unit;
    return sep(n) + " B";
  }
  function gb(n) {  // decimal gigabytes, the unit of spec sheets and of chapter 5
    const x = n / 1e9;
    return sep(x, x < 10 ? 2 : x < 100 ? 1 : 0) + " GB";
  }
  function sig3(x) { return Number(x.toPrecision(3)); }
  function sig3text(x) {  // 3 significant figures, with separators: 34,900 or 4.64
    const v = sig3(x), digits = Math.max(0, 2 - Math.floor(Math.log10(Math.abs(v))));
    return v.toLocaleString("en", { maximumFractionDigits: digits });
  }
  function rateText(bw) {  // a bandwidth: 3.35 TB/s, 320 GB/s
    return bw >= 1e12 ? sig3text(bw / 1e12) + " TB/s" : sig3text(bw / 1e9) + " GB/s";
  }
  function count(n, word) { return sep(n) + " " + word + (n === 1 ? "" : "s"); }
  function pct(x) { return (100 * x).toFixed(1) + "%"; }

  // -- page elements -------------------------------------------------------------------------------
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
  function note(box, text) { const p = el("p", { class: "kv-note" }, text); box.append(p); return p; }
  function figure(box, title) {  // a titled figure whose picture is redrawn at its width
    const f = el("figure", { class: "kv-figure" });
    const cap = el("figcaption", { class: "kv-figtitle" }, title);
    const pic = el("div", { class: "kv-picture" });
    f.append(cap, pic);
    box.append(f);
    return { title: cap, picture: pic, width: () => Math.max(240, Math.min(pic.clientWidth || 520, 640)) };
  }
  function esc(s) { return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/"/g, "&quot;"); }

  // -- pictures ------------------------------------------------------------------------------------
  // Colours of the data (Okabe-Ito, legible on light and dark pages); text and axes
  // are currentColor, the theme's text colour (see explorers.css).
  const BLUE = "#0072B2", RED = "#D55E00", GREY = "#8C8C8C", GREEN = "#009E73", ORANGE = "#E69F00";
  function svgOpen(w, h, label) {
    return '<svg xmlns="http://www.w3.org/2000/svg" class="kv-svg" width="' + w + '" height="' + h +
      '" viewBox="0 0 ' + w + " " + h + '" role="img" aria-label="' + esc(label) + '">';
  }
  function text(x, y, s, extra) {
    return '<text x="' + x.toFixed(1) + '" y="' + y.toFixed(1) + '" fill="currentColor" ' +
      (extra || "") + ">" + esc(s) + "</text>";
  }
  // Horizontal bars on one scale. items: [name, value, colour, value as text]; a value
  // above `max` is drawn to the edge and marked with an arrow.
  function bars(w, items, max, label) {
    const row = 26, h = row * items.length + 6;
    const longest = Math.max(...items.map(it => it[0].length));
    const left = Math.min(Math.round(7 * longest) + 12, Math.round(0.45 * w));
    const valueRoom = 78, span = Math.max(20, w - left - valueRoom);
    const svg = [svgOpen(w, h, label)];
    items.forEach(([name, v, color, valueText], i) => {
      const y = 4 + i * row, len = max > 0 ? span * Math.min(v, max) / max : 0;
      svg.push(text(left - 6, y + 14, name, 'text-anchor="end" font-size="12"'));
      svg.push('<rect class="kv-bar" x="' + left + '" y="' + y + '" width="' + len.toFixed(1) +
               '" height="18" fill="' + color + '"/>');
      svg.push(text(left + len + 5, y + 14, valueText + (v > max ? " →" : ""), 'font-size="12"'));
    });
    return svg.join("") + "</svg>";
  }
  function tickText(v) {  // a power of ten, plainly: 0.01, 1, 1,000
    return v >= 1 ? sep(v) : String(Number(v.toPrecision(1)));
  }
  // The roofline, log-log: attainable FLOP/s = min(peak, intensity × bandwidth), with the
  // ridge where the two roofs meet and the step as a dot on the roof.
  function roofline(w, t, peak, bw, label) {
    const h = 210, left = 52, right = 10, top = 10, bottom = 40;
    const xLo = -1, xHi = 4;  // 0.1 ... 10,000 FLOPs per byte
    const yHi = Math.ceil(Math.log10(peak / 1e12) + 0.2), yLo = yHi - 5;  // TFLOP/s decades
    const X = i => left + (w - left - right) * (Math.log10(i) - xLo) / (xHi - xLo);
    const Y = f => top + (h - top - bottom) * (yHi - Math.log10(f / 1e12)) / (yHi - yLo);
    const roofAt = i => Math.min(peak, i * bw);
    const svg = [svgOpen(w, h, label)];
    for (let e = xLo; e <= xHi; e++) {  // x ticks: every decade
      const x = X(10 ** e);
      svg.push('<line class="kv-grid" x1="' + x.toFixed(1) + '" x2="' + x.toFixed(1) + '" y1="' + top +
               '" y2="' + (h - bottom) + '"/>');
      svg.push('<line class="kv-axis" stroke="currentColor" x1="' + x.toFixed(1) + '" x2="' +
               x.toFixed(1) + '" y1="' + (h - bottom) + '" y2="' + (h - bottom + 4) + '"/>');
      svg.push(text(x, h - bottom + 15, tickText(10 ** e), 'class="kv-xtick" text-anchor="middle" font-size="11"'));
    }
    for (let e = yLo; e <= yHi; e++) {  // y ticks: every decade of TFLOP/s
      const y = Y(10 ** e * 1e12);
      svg.push('<line class="kv-grid" x1="' + left + '" x2="' + (w - right) + '" y1="' + y.toFixed(1) +
               '" y2="' + y.toFixed(1) + '"/>');
      svg.push('<line class="kv-axis" stroke="currentColor" x1="' + (left - 4) + '" x2="' + left +
               '" y1="' + y.toFixed(1) + '" y2="' + y.toFixed(1) + '"/>');
      svg.push(text(left - 6, y + 4, tickText(10 ** e), 'class="kv-ytick" text-anchor="end" font-size="11"'));
    }
    svg.push('<path class="kv-axis" d="M' + left + " " + top + " V" + (h - bottom) + " H" + (w - right) +
             '" fill="none" stroke="currentColor"/>');
    const roof = [];
    for (let e = xLo; e <= xHi + 1e-9; e += 0.05) {
      const i = 10 ** e;
      roof.push(X(i).toFixed(1) + "," + Y(roofAt(i)).toFixed(1));
    }
    svg.push('<polyline class="kv-roof" fill="none" stroke="' + BLUE + '" stroke-width="2.5" points="' +
             roof.join(" ") + '"/>');
    const rx = X(t.ridge), ry = Y(peak);  // the ridge: a dashed line down from the corner
    svg.push('<line class="kv-ridge" x1="' + rx.toFixed(1) + '" x2="' + rx.toFixed(1) + '" y1="' +
             ry.toFixed(1) + '" y2="' + (h - bottom) + '" stroke-dasharray="4 3"/>');
    const onLeft = rx > left + 0.55 * (w - left - right);
    svg.push(text(rx + (onLeft ? -5 : 5), h - bottom - 6, "ridge " + sig3text(t.ridge),
                  'class="kv-ridge-label" font-size="11" text-anchor="' + (onLeft ? "end" : "start") + '"'));
    const i = Math.min(Math.max(t.intensity, 10 ** xLo), 10 ** xHi);
    svg.push('<circle cx="' + X(i).toFixed(1) + '" cy="' + Y(roofAt(i)).toFixed(1) + '" r="5.5" fill="' +
             RED + '" stroke="white" stroke-width="1"/>');
    svg.push(text(left + (w - left - right) / 2, h - 6, "FLOPs per byte (log scale)",
                  'text-anchor="middle" font-size="11"'));
    svg.push(text(12, top + (h - top - bottom) / 2, "TFLOP/s (log)",
                  'font-size="11" text-anchor="middle" transform="rotate(-90 12 ' +
                  (top + (h - top - bottom) / 2) + ')"'));
    return svg.join("") + "</svg>";
  }
  function legend(items) {  // [[kind, colour, text]]: kind "line", "dot" or "dash"
    const p = el("p", { class: "kv-legend" });
    for (const [kind, color, label] of items) {
      const span = el("span", { class: "kv-key" });
      const mark = kind === "dot"
        ? '<circle cx="9" cy="6" r="5" fill="' + color + '"/>'
        : '<line x1="0" x2="18" y1="6" y2="6" stroke="' + color + '" stroke-width="2.5"' +
          (kind === "dash" ? ' stroke-dasharray="4 3" class="kv-ridge"' : "") + "/>";
      span.innerHTML = '<svg width="18" height="12" aria-hidden="true">' + mark + "</svg>";
      span.append(" " + label);
      p.append(span);
    }
    return p;
  }
  // Redraw a box's pictures when its width changes (a phone turned, a sidebar opened).
  function onResize(box, draw) {
    if (typeof ResizeObserver === "undefined") return;
    let last = box.clientWidth;
    new ResizeObserver(() => {
      if (box.clientWidth !== last) { last = box.clientWidth; draw(); }
    }).observe(box);
  }

  // -- the three explorers -------------------------------------------------------------------------
  const BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256];

  // kvbook.explorer.formula_text: the terms written out, one per kind of layer
  function formulaText(terms, m, b, width) {
    const hybrid = !(terms.length === 1 && terms[0].kind === "full");
    const parts = [];
    let shared = 0;
    for (const t of terms) {
      const label = hybrid ? t.kind + " layer" : "layer";
      if (t.kind.startsWith("shared")) shared += t.layers;
      else if (t.kind.startsWith("latent")) {
        parts.push(count(t.layers, label) + " × " + count(b, "sequence") + " × " + count(t.tokens, "token") +
                   " × " + count(t.numbers, "number") + " × " + count(width, "byte"));
      } else {
        parts.push("2 (K and V) × " + count(t.layers, label) + " × " + count(b, "sequence") + " × " +
                   count(m.n_kv_head, "KV head") + " × " + count(t.tokens, "token") + " × " +
                   count(m.head_dim, "dim") + " × " + count(width, "byte"));
      }
    }
    return parts.join(" + ") + (shared ? " (and 0 for " + count(shared, "shared layer") + ")" : "");
  }

  // kvbook.explorer.kv_heads_apply: some layer stores K and V per head (not MLA's latent)
  function headsApply(m) { return m.layers.some(k => k.kind !== "latent" && k.kind !== "shared"); }
  // kvbook.explorer.limit_text: a context past the model's limit (its max_seq_len)
  function limitText(m, s) {
    return s <= m.max_seq_len ? "" : sep(s) + " tokens is past " + m.name + "'s context limit of " +
      sep(m.max_seq_len) + " tokens (the longest it was trained for): the arithmetic holds, but the " +
      "model is not made to serve it.";
  }
  // kvbook.explorer.heads_text: why the KV-heads control does nothing for an MLA model
  function headsText(m) {
    const latent = m.layers.find(k => k.kind === "latent");
    return headsApply(m) || !latent ? "" : m.name + " caches one latent of " + sep(latent.size) +
      " numbers per token in each layer (MLA), not keys and values per head: its number of KV heads " +
      "does not change the cache.";
  }

  function cacheExplorer(box, data) {  // mirrors kvbook.explorer.cache_report
    const form = el("form", { class: "kv-controls" });
    const models = Object.entries(data.models).map(([k, m]) => [k, m.name]);
    const model = control(form, "model", models, "llama-2-7b");
    const dtype = control(form, "cache dtype", Object.keys(data.dtype_bytes).map(k => [k, k]), "fp16");
    const batch = control(form, "batch (sequences)", BATCHES.map(b => [b, sep(b)]), 8);
    const ctx = control(form, "context (tokens per sequence)", data.contexts.map(c => [c, sep(c)]), 4096);
    const heads = control(form, "KV heads per layer", [], 0);
    const gpu = control(form, "GPU memory (GiB)", data.gpus_gib.map(g => [g, sep(g)]), 80);
    const out = el("div", { class: "kv-outputs" });
    // said only when true: a context past the model's limit, and why MLA has no heads to choose
    const limit = el("p", { class: "kv-warning", "data-name": "limit", "aria-live": "polite" });
    const headsNote = el("p", { class: "kv-note", "data-name": "heads_note", id: heads.id + "-why" });
    out.append(limit, headsNote);
    note(out, "The cache is stored in the cache dtype; the weights stay in fp16.");
    const formula = el("p", { "data-name": "formula" });
    out.append(formula);
    const cache = output(out, "cache_bytes", "KV cache");
    const weights = output(out, "weight_bytes", "weights (fp16)");
    const fits = output(out, "fits", "weights + cache");
    const fig = figure(out, "Memory: the weights and the KV cache against the GPU");
    box.append(form, out);
    function refillHeads() {
      const m = data.models[model.value], apply = headsApply(m);
      // MLA caches one latent per token: no number of heads to choose, and the note says why
      if (apply) setOptions(heads, m.kv_heads.map(h => [h, sep(h)]), m.n_kv_head);
      else setOptions(heads, [["", "none (MLA)"]], "");
      heads.disabled = !apply;
      if (apply) heads.removeAttribute("aria-describedby");
      else heads.setAttribute("aria-describedby", headsNote.id);
      headsNote.textContent = headsText(m);
      headsNote.hidden = apply;
    }
    function refresh() {
      const preset = data.models[model.value];
      const m = Object.assign({}, preset, { n_kv_head: heads.disabled ? preset.n_kv_head : Number(heads.value) });
      const width = data.dtype_bytes[dtype.value], b = Number(batch.value), s = Number(ctx.value);
      const c = kvCacheBytes(m, s, b, width);
      // cache_report's weight_dtype="fp16"; a "shapes" preset's weights are not counted
      const counted = m.param_count !== null;
      const w = counted ? paramCount(m) * data.dtype_bytes.fp16 : 0;
      const g = Number(gpu.value) * data.gib;
      formula.textContent = formulaText(cacheTerms(m, s, b, width), m, b, width);
      show(cache, c, size(c) + " (" + sep(c) + " bytes)" + (counted ? ", " + sep(c / w, 2) + "× the weights" : ""));
      if (counted) show(weights, w, size(w));
      else show(weights, "", "not counted: kvlib keeps only this model's cache shapes");
      const ok = w + c <= g;
      show(fits, ok, (counted ? size(w + c) + ", which " : "the cache alone, which ") +
           (ok ? "fits" : "does not fit") + " in " + size(g));
      box.classList.toggle("kv-overflow", !ok);  // "does not fit" in red, as in the step explorer
      limit.textContent = limitText(m, s);
      limit.hidden = !limit.textContent;
      const top = Math.max(w, c, g);
      const items = (counted ? [["weights", w, BLUE, size(w)]] : []).concat(
        [["KV cache", c, RED, size(c)], ["GPU memory", g, GREY, size(g)]]);
      fig.picture.innerHTML = bars(fig.width(), items, top,
                                   (counted ? "weights " + size(w) + ", " : "") + "KV cache " + size(c) +
                                   ", GPU " + size(g));
    }
    model.addEventListener("change", () => { refillHeads(); refresh(); });
    for (const s of [dtype, batch, ctx, heads, gpu]) s.addEventListener("change", refresh);
    refillHeads();
    refresh();
    onResize(box, refresh);
  }

  function stepExplorer(box, data) {  // mirrors kvlib.hardware.step_time
    const form = el("form", { class: "kv-controls" });
    const hwNames = Object.entries(data.hardware).map(([k, h]) => [k, h.name]);
    const hw = control(form, "hardware", hwNames, "h100");
    const model = control(form, "model", data.step_models.map(k => [k, data.models[k].name]),
                          "llama-3-8b");
    const dtype = control(form, "dtype (weights and cache)", [], "bf16");
    const batch = control(form, "batch (sequences)", BATCHES.map(b => [b, sep(b)]), 1);
    const ctx = control(form, "context (tokens per sequence)", data.contexts.map(c => [c, sep(c)]), 4096);
    // Controls and charts side by side where the box is wide enough, the numbers under both
    // (explorers.css, .kv-side): a control moved shows its chart move, on a laptop's screen.
    // On a phone they stack: the controls, then the charts, then the note and the numbers.
    const side = el("div", { class: "kv-side" }), charts = el("div", { class: "kv-charts" });
    const bytesFig = figure(charts, "Bytes read per decode step");
    const roofFig = figure(charts, "");
    const about = el("div", { class: "kv-about" });  // under the controls, beside the charts
    note(about, "One decode step on the spec sheet's bandwidth and peak, with the weights and the " +
                "cache both stored in the chosen dtype.");
    const out = el("div", { class: "kv-outputs" });
    const limit = el("p", { class: "kv-warning", "data-name": "limit", "aria-live": "polite" });
    out.append(limit);
    const fits = output(out, "fits", "memory");
    const time = output(out, "step_seconds", "predicted decode step");
    const rate = output(out, "tokens_per_s", "tokens per second (the whole batch)");
    const share = output(out, "kv_share", "share of the step's bytes that is KV cache");
    const bound = output(out, "bound", "arithmetic intensity");
    note(out, "A step reads every weight matrix but only one row of the embedding table per " +
              "sequence, so it reads a little less than the weights hold.");
    side.append(form, charts, about, out);
    box.append(side);
    function refillDtypes() {
      const listed = data.step_dtypes.filter(d => d in data.hardware[hw.value].peak_flops);
      const want = dtype.value || "bf16";  // keep the reader's choice where this hardware has it
      const keep = listed.includes(want) ? want : listed.includes("fp16") ? "fp16" : listed[0];
      setOptions(dtype, listed.map(d => [d, d]), keep);
    }
    function refresh() {
      const h = data.hardware[hw.value], m = data.models[model.value];
      const b = Number(batch.value), s = Number(ctx.value), width = data.dtype_bytes[dtype.value];
      const t = stepTime(m, h, b, s, dtype.value, data.dtype_bytes);
      const mem = memoryBytes(m, b, s, width), ok = mem.total <= h.memory;
      fits.dataset.bytes = String(mem.total);
      show(fits, ok, (ok ? "fits: needs " : "does not fit: needs ") + gb(mem.total) + " (weights " +
           gb(mem.weights) + " + KV cache " + gb(mem.cache) + "), the GPU has " + sig3text(h.memory / 1e9) + " GB");
      box.classList.toggle("kv-overflow", !ok);
      limit.textContent = limitText(m, s);  // the same words as chapter 4's explorer
      limit.hidden = !limit.textContent;
      show(time, t.total, sig3text(1e3 * t.total) + " ms" +
           (ok ? "" : ", on paper only: the weights and cache do not fit this GPU"));
      show(rate, b / t.total, sig3text(b / t.total) + " tokens/s");
      show(share, t.kv / t.bytes, (100 * t.kv / t.bytes).toFixed(1) + "% (weights " +
           (100 * t.weights / t.bytes).toFixed(1) + "%)");
      const memBound = t.intensity < t.ridge;
      show(bound, memBound ? "memory" : "compute", sig3text(t.intensity) +
           " FLOPs per byte, " + (memBound ? "below" : "above") + " the ridge of " + sig3text(t.ridge) +
           " FLOPs per byte: " + (memBound ? "memory-bound" : "compute-bound"));
      bytesFig.picture.innerHTML = bars(bytesFig.width(), [["weights", t.weights, BLUE, gb(t.weights)],
                                                           ["KV cache", t.kv, RED, gb(t.kv)]],
                                        Math.max(t.weights, t.kv),
                                        "bytes per step: weights " + gb(t.weights) + ", KV cache " + gb(t.kv));
      const peak = h.peak_flops[dtype.value];
      roofFig.title.textContent = "Roofline of the " + h.name + " in " + dtype.value;
      roofFig.picture.innerHTML = roofline(roofFig.width(), t, peak, h.mem_bandwidth,
        "roofline of " + h.name + ": the step at " + sig3(t.intensity) + " FLOPs per byte, " +
        (memBound ? "under the sloped, memory-bound roof" : "under the flat, compute-bound roof") +
        "; the ridge at " + sig3(t.ridge) + " FLOPs per byte");
      roofFig.picture.append(legend([
        ["line", BLUE, "roof: the lower of " + sig3text(peak / 1e12) + " TFLOP/s and " +
                       rateText(h.mem_bandwidth) + " × FLOPs per byte"],
        ["dash", "", "ridge: where the two roofs meet"],
        ["dot", RED, "this step"]]));
    }
    hw.addEventListener("change", () => { refillDtypes(); refresh(); });
    for (const c of [model, dtype, batch, ctx]) c.addEventListener("change", refresh);
    refillDtypes();
    refresh();
    onResize(box, refresh);
  }

  function pagingExplorer(box, data) {  // reads the table kvbook.web.paging_table simulated
    const p = data.paging, d = p.default;
    const form = el("form", { class: "kv-controls" });
    const traceNames = Object.entries(p.traces).map(([k, t]) =>
      [k, t.label + ": " + sep(t.prompt_median) + " + " + sep(t.output_median)]);
    const trace = control(form, "requests (median prompt + output, tokens)", traceNames, d.trace);
    const maxLen = control(form, "context limit (tokens)", p.max_lens.map(m => [m, sep(m)]), d.max_len);
    const block = control(form, "block size (tokens)", p.blocks.map(b => [b, sep(b)]), d.block);
    const out = el("div", { class: "kv-outputs" });
    const about = note(out, "");
    note(out, "Waste is the share of the occupied pool that holds no token's keys and values: " +
              "slots reserved for tokens a request has not produced yet, slots beyond its final " +
              "length, and gaps between reservations too small to use.");
    const wMax = output(out, "waste_max", "waste, reserving the context limit for every request");
    const wPow2 = output(out, "waste_pow2",
                         "waste, reserving the final length rounded up to a power of two");
    const wOracle = output(out, "waste_oracle", "waste, reserving exactly the final length");
    const wPaged = output(out, "waste_paged", "waste, paged");
    const batchOut = output(out, "batch", "requests running at once");
    const mean = output(out, "mean_len", "mean request length of this trace (prompt + output)");
    note(out, "A power of two and the exact length both need the output length in advance, which " +
              "no server has: they bound what predicting it could achieve.");
    const fig = figure(out, "Waste of the occupied pool, by policy");
    box.append(form, out);
    function refresh() {
      const key = trace.value, t = p.traces[key], limit = Number(maxLen.value), bs = block.value;
      const row = p.rows.find(r => r.trace === key && r.max_len === limit);
      const w = row.waste, paged = w.paged[bs];
      about.textContent = "Simulated by kvlib.simulate: " + sep(p.requests) + " requests, all queued " +
        "at the start, served first come, first served from a pool of " + sep(t.pool) +
        " token slots. The chat-like and short-exchange traces are chapter 9's own.";
      show(wMax, w.max, pct(w.max));
      show(wPow2, w.pow2, pct(w.pow2));
      show(wOracle, w.oracle, pct(w.oracle));
      show(wPaged, paged, pct(paged) + " with " + sep(Number(bs)) + "-token blocks");
      show(batchOut, row.batch.paged[bs], sep(row.batch.max, 1) + " reserving the limit, " +
           sep(row.batch.paged[bs], 1) + " paged (a mean over the busy period)");
      show(mean, row.mean_len, sep(row.mean_len) + " tokens");
      fig.picture.innerHTML = bars(fig.width(), [
        ["context limit", w.max, RED, pct(w.max)], ["power of two", w.pow2, ORANGE, pct(w.pow2)],
        ["exact length", w.oracle, GREY, pct(w.oracle)], ["paged", paged, GREEN, pct(paged)]], 1,
        "waste: reserving the context limit " + pct(w.max) + ", a power of two " + pct(w.pow2) +
        ", the exact length " + pct(w.oracle) + ", paged " + pct(paged));
    }
    for (const c of [trace, maxLen, block]) c.addEventListener("change", refresh);
    refresh();
    onResize(box, refresh);
  }

  // -- the knobs' explorers (kvbook.knobs): a mask, a quantized cache's bytes, a draft's yield ------
  // kvlib.layers.visible: may the query at q see the key at k in a layer of this kind?
  function visible(k, q, key) {
    if (key > q) return false;  // causal, for every kind
    if (k.kind === "window") return key > q - k.size || key < k.sinks;
    if (k.kind === "chunked") return Math.floor(key / k.size) === Math.floor(q / k.size);
    return true;
  }
  // kvbook.knobs.numbers: a list of ints, runs shortened: 0, 1, 8–11
  function runs(xs) {
    const parts = [];
    for (let i = 0; i < xs.length;) {
      let j = i;
      while (j + 1 < xs.length && xs[j + 1] === xs[j] + 1) j++;
      parts.push(j === i ? String(xs[i]) : j === i + 1 ? xs[i] + ", " + xs[j] : xs[i] + "–" + xs[j]);
      i = j + 1;
    }
    return parts.join(", ") || "none";
  }
  // One cell of a grid: filled with `color`, or a faint grey when `color` is null (off).
  function square(cls, data, x, y, cell, color) {
    return '<rect class="' + cls + '" ' + data + ' x="' + x.toFixed(1) + '" y="' + y.toFixed(1) + '" width="' +
      (cell - 1).toFixed(1) + '" height="' + (cell - 1).toFixed(1) + '" fill="' + (color || GREY) +
      '" fill-opacity="' + (color ? 1 : 0.15) + '"/>';
  }
  function range(lo, hi) { return Array.from({ length: hi - lo + 1 }, (_, i) => lo + i); }
  // A knob's explorer: its controls beside its figure where the box is wide (.kv-side), a note
  // under the controls, and its outputs ([data-name, label] each) under both.
  function knobFrame(box, form, title, about, outputs) {
    const side = el("div", { class: "kv-side" }), charts = el("div", { class: "kv-charts" });
    const aboutBox = el("div", { class: "kv-about" }), out = el("div", { class: "kv-outputs" });
    side.append(form, charts, aboutBox, out);
    box.append(side);
    note(aboutBox, about);
    return { fig: figure(charts, title), out: outputs.map(([name, label]) => output(out, name, label)) };
  }

  function masksExplorer(box, data) {  // mirrors kvbook.knobs.masks.mask_report
    const form = el("form", { class: "kv-controls" });
    const kind = control(form, "kind of layer", [["full", "full"], ["window", "window"], ["chunked", "chunked"]],
                         box.dataset.kind || "window");
    const win = control(form, "window (tokens)", range(1, 16).map(w => [w, sep(w)]), box.dataset.window || 4);
    const sinks = control(form, "sinks", range(0, 4).map(s => [s, sep(s)]), box.dataset.sinks || 2);
    const chunk = control(form, "chunk (tokens)", range(1, 16).map(c => [c, sep(c)]), 4);
    const len = control(form, "text (tokens)", range(1, 32).map(n => [n, sep(n)]), box.dataset.n || 12);
    const { fig, out: [name, held, kept] } = knobFrame(box, form,
      "Which keys each query may see, and what the cache keeps",
      "Blue: the query (row) may attend to the key (column). Red: the tokens the layer's cache holds " +
      "after the text, the last row.",
      [["kind", "layer"], ["tokens_held", "tokens the cache holds"], ["kept", "their positions"]]);
    function refresh() {
      const k = { kind: kind.value, size: kind.value === "window" ? Number(win.value) : Number(chunk.value),
                  sinks: kind.value === "window" ? Number(sinks.value) : 0, source: null };
      win.disabled = sinks.disabled = k.kind !== "window";
      chunk.disabled = k.kind !== "chunked";
      const n = Number(len.value), keep = range(0, n - 1).filter(key => visible(k, n - 1, key));
      show(name, kindName(k), kindName(k));
      show(held, tokensHeld(k, n), sep(tokensHeld(k, n)));
      show(kept, keep.join(","), runs(keep));
      const w = fig.width(), left = 44, top = 18;
      const cell = Math.max(4, Math.min(20, (Math.min(w, 380) - left - 8) / n)), size = cell * n;
      const svg = [svgOpen(left + size + 8, top + size + cell + 40, kindName(k) + ": which keys each of " + n +
                           " queries sees; the cache keeps " + runs(keep))];
      svg.push(text(left + size / 2, 12, "key →", 'text-anchor="middle" font-size="12"'));
      svg.push(text(left - 6, top + 10, "query", 'text-anchor="end" font-size="12"'));
      for (let q = 0; q < n; q++) {
        for (let key = 0; key < n; key++) {
          const seen = visible(k, q, key);
          svg.push(square(seen ? "kv-seen" : "kv-hidden", 'data-q="' + q + '" data-k="' + key + '"',
                          left + key * cell, top + q * cell, cell, seen ? BLUE : null));
        }
      }
      const y = top + size + 12;
      svg.push(text(left - 6, y + cell - 2, "kept", 'text-anchor="end" font-size="12"'));
      for (let key = 0; key < n; key++) {
        const on = keep.includes(key);
        svg.push(square(on ? "kv-kept" : "kv-gone", 'data-k="' + key + '"', left + key * cell, y, cell, on ? RED : null));
      }
      svg.push(text(left, y + cell + 16, "0", 'font-size="12"'));
      svg.push(text(left + size, y + cell + 16, String(n - 1), 'text-anchor="end" font-size="12"'));
      fig.picture.innerHTML = svg.join("") + "</svg>";
    }
    for (const c of [kind, win, sinks, chunk, len]) c.addEventListener("change", refresh);
    refresh();
    onResize(box, refresh);
  }

  // kvlib.quant.quantized_nbytes / numbers: packed codes, and an fp16 scale and minimum per group
  function quantBytesPerNumber(bits, group) { return bits / 8 + (2 + 2) / group; }

  function quantExplorer(box, data) {  // mirrors kvbook.knobs.quant's bytes
    const form = el("form", { class: "kv-controls" });
    const bits = control(form, "bits", [[2, "2"], [4, "4"], [8, "8"]], 4);
    const group = control(form, "numbers per scale", [8, 16, 32, 64].map(g => [g, sep(g)]), 64);
    const model = control(form, "model", Object.entries(data.models).map(([k, m]) => [k, m.name]), "smollm2-135m");
    const { fig, out: [perNumber, perToken, share] } = knobFrame(box, form,
      "Bytes per token of the cache: fp16 against this setting",
      "n-bit codes packed into bytes, plus an fp16 scale and minimum for each group of numbers, as " +
      "kvlib.quant stores them. The error needs the tensors: run the notebook.",
      [["bytes_per_number", "bytes per number"], ["token_bytes", "bytes per token (every layer)"],
       ["share", "of fp16's bytes"]]);
    function refresh() {
      const b = Number(bits.value), g = Number(group.value), m = data.models[model.value];
      const per = quantBytesPerNumber(b, g), numbers = kvCacheBytes(m, 1, 1, 1);  // kv_bytes_per_token(m, 1)
      const fp16 = numbers * data.dtype_bytes.fp16, mine = per * numbers;
      show(perNumber, per, sep(per, 4) + " (" + sep(b / 8, 4) + " of codes + " + sep(4 / g, 4) + " of scales)");
      show(perToken, mine, sep(mine) + " bytes, against " + sep(fp16) + " in fp16");
      show(share, mine / fp16, pct(mine / fp16));
      fig.picture.innerHTML = bars(fig.width(), [["fp16", fp16, GREY, sep(fp16) + " B"],
                                                 [b + " bits / " + g, mine, BLUE, sep(mine) + " B"]], fp16,
                                   "bytes per token: fp16 " + sep(fp16) + ", " + b + " bits with a scale per " + g +
                                   " numbers " + sep(mine));
    }
    for (const c of [bits, group, model]) c.addEventListener("change", refresh);
    refresh();
    onResize(box, refresh);
  }

  // kvlib.speculative.expected_tokens_per_forward: 1 + a + ... + a^k
  function expectedTokens(k, a) { let t = 0; for (let i = 0; i <= k; i++) t += a ** i; return t; }

  function speculateExplorer(box, data) {  // mirrors kvbook.knobs.speculative's formula
    const form = el("form", { class: "kv-controls" });
    const k = control(form, "draft length k", range(1, 8).map(j => [j, sep(j)]), 4);
    const a = control(form, "chance a guess is right", range(0, 20).map(i => [i / 20, (i / 20).toFixed(2)]), 0.75);
    const { fig, out: [tokens, extra] } = knobFrame(box, form,
      "Tokens per verify forward against the draft length",
      "Each guess right with the same chance, independently: a verify step keeps its guesses up to " +
      "the first wrong one, plus the target's own token.",
      [["tokens_per_forward", "tokens per verify forward"], ["last_guess", "tokens the k-th guess adds"]]);
    function refresh() {
      const kk = Number(k.value), aa = Number(a.value), t = expectedTokens(kk, aa);
      show(tokens, t, sep(t, 3) + " (at most " + sep(kk + 1) + ")");
      show(extra, aa ** kk, sep(aa ** kk, 3));
      const w = fig.width(), h = 210, left = 40, right = 12, top = 10, bottom = 40;
      const X = j => left + (w - left - right) * (j - 0.5) / 8, Y = t => top + (h - top - bottom) * (9 - t) / 8;
      const svg = [svgOpen(w, h, "tokens per verify forward at a = " + aa.toFixed(2) + ": " + sep(t, 2) +
                           " at k = " + kk)];
      svg.push('<path class="kv-axis" d="M' + left + " " + top + " V" + (h - bottom) + " H" + (w - right) +
               '" fill="none" stroke="currentColor"/>');
      for (let y = 1; y <= 9; y += 2) svg.push(text(left - 6, Y(y) + 4, String(y), 'text-anchor="end" font-size="11"'));
      for (let j = 1; j <= 8; j++) svg.push(text(X(j), h - bottom + 15, String(j), 'text-anchor="middle" font-size="11"'));
      svg.push(text(left + (w - left - right) / 2, h - 6, "draft length k", 'text-anchor="middle" font-size="11"'));
      svg.push('<polyline class="kv-ridge" fill="none" stroke-dasharray="4 3" points="' +
               range(1, 8).map(j => X(j).toFixed(1) + "," + Y(j + 1).toFixed(1)).join(" ") + '"/>');
      svg.push('<polyline class="kv-formula" fill="none" stroke="' + BLUE + '" stroke-width="2.5" points="' +
               range(1, 8).map(j => X(j).toFixed(1) + "," + Y(expectedTokens(j, aa)).toFixed(1)).join(" ") + '"/>');
      svg.push('<circle cx="' + X(kk).toFixed(1) + '" cy="' + Y(t).toFixed(1) + '" r="5.5" fill="' + RED + '"/>');
      fig.picture.innerHTML = svg.join("") + "</svg>";
      fig.picture.append(legend([["line", BLUE, "1 + a + … + a^k"], ["dash", "", "the ceiling, k + 1"],
                                 ["dot", RED, "this k"]]));
    }
    for (const c of [k, a]) c.addEventListener("change", refresh);
    refresh();
    onResize(box, refresh);
  }

  const EXPLORERS = { cache: cacheExplorer, step: stepExplorer, paging: pagingExplorer, masks: masksExplorer,
                      quant: quantExplorer, speculate: speculateExplorer };
  // An explorer in a file of its own registers itself before the page is ready:
  // window.kvExplorers = Object.assign(window.kvExplorers || {}, { name: function (box, data) {...} }).
  const explorerOf = name => EXPLORERS[name] || (window.kvExplorers || {})[name];
  // What such a file may use of this one: its element maker and its escaping of text for SVG.
  window.kvExplorerKit = { el: el, esc: esc };

  // The data is a script, explorers-data.js, that sets window.kvExplorerData (written by
  // `python -m kvbook.web`). A script, not a JSON file to fetch: a page opened from disk
  // (file://) may not fetch the file beside it, but it may run it. Added only to the pages that
  // have an explorer, so no other page loads it.
  function start() {
    const boxes = document.querySelectorAll("div.kv-explorer[data-explorer]");
    if (!boxes.length) return;
    const fail = why => boxes.forEach(box => { box.textContent = "The explorer could not load: " + why; });
    const root = document.documentElement.dataset.content_root || "./";
    const script = el("script", { src: root + "_static/explorers-data.js" });
    script.onload = () => {
      const data = window.kvExplorerData;
      if (!data) { fail("explorers-data.js set no data"); return; }
      boxes.forEach(box => {
        const make = explorerOf(box.dataset.explorer);
        if (!make) { box.textContent = "No explorer is named " + box.dataset.explorer; return; }
        make(box, data);
        box.dataset.ready = "true";
      });
    };
    script.onerror = () => fail(script.src + " is missing (run `python -m kvbook.web`)");
    document.head.append(script);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
