// The search page's snippets (kvbook.search, loaded on search.html only, after Sphinx's
// searchtools.js). Sphinx cut a result's snippet around the first place its words appear in
// the page's main element, which begins with the page's header (its buttons, "PDF") and the
// in-page table of contents ("Contents 9.1 Overview 9.2 ..."). Here the text is the
// article's own, with code cells, navigation and the contents left out, and the snippet is
// centred where the query's words stand together (else on the first of them found).
(function () {
  if (typeof Search === "undefined") return;
  var LEFT_OUT = ["nav", ".bd-header-article", ".bd-toc", ".toctree-wrapper", ".prev-next-area",
                  "div.cell_input", ".headerlink", "script", "style", "footer"];
  var SPAN = 240;

  // A page found through a concept's entry is listed once, at that entry, not again below
  // it for the same words in its text. (Results run worst to best: the page shows them from
  // the end.)
  var perform = Search._performSearch;
  Search._performSearch = function () {
    var results = perform.apply(this, arguments);
    var byConcept = new Set(results.filter(function (r) { return String(r[2]).indexOf("#concept-") === 0; })
                                   .map(function (r) { return r[0]; }));
    return results.filter(function (r) { return r[2] || !byConcept.has(r[0]); });
  };

  Search.htmlToText = function (htmlString, anchor) {
    var doc = new DOMParser().parseFromString(htmlString, "text/html");
    var main = doc.querySelector("article") || doc.querySelector('[role="main"]');
    if (!main) return "";
    // an anchor that marks a place (a concept's entry) stands for the section around it
    var part = anchor ? main.querySelector(anchor) : null;
    if (part && !part.textContent.trim()) part = part.closest("section");
    part = part || main;
    part.querySelectorAll(LEFT_OUT.join(", ")).forEach(function (el) { el.remove(); });
    return part.textContent.replace(/\s+/g, " ").trim();
  };

  Search.makeSearchSummary = function (htmlText, keywords, anchor) {
    var text = Search.htmlToText(htmlText, anchor);
    if (!text) return null;
    var lower = text.toLowerCase();
    var keys = Array.from(keywords).map(function (k) { return k.toLowerCase(); });
    var where = -1;
    // the first place where every word of the query falls within one snippet
    for (var i = lower.indexOf(keys[0]); i > -1 && where < 0; i = lower.indexOf(keys[0], i + 1)) {
      var around = lower.substr(Math.max(0, i - SPAN / 2), SPAN);
      if (keys.every(function (k) { return around.indexOf(k) > -1; })) where = i;
    }
    if (where < 0) {
      var found = keys.map(function (k) { return lower.indexOf(k); }).filter(function (n) { return n > -1; });
      where = found.length ? Math.min.apply(null, found) : 0;
    }
    var start = Math.max(where - SPAN / 2, 0);
    var summary = document.createElement("p");
    summary.classList.add("context");
    summary.textContent = (start > 0 ? "..." : "") + text.substr(start, SPAN).trim() +
                          (start + SPAN < text.length ? "..." : "");
    return summary;
  };
})();
