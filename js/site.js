// The sidebar buttons, mended without patching the themes' files.
//
// pydata-sphinx-theme 0.17 (its issue #2451) added a navbar with its own sidebar button,
// hidden under sphinx-book-theme. Both themes bind their handlers to the FIRST
// `.primary-toggle` / `.secondary-toggle` in the page, which is that hidden button, so the
// buttons a reader sees (the article header's) do nothing: no drawer opens on a phone,
// and the sidebar does not collapse on a desktop. Each visible button forwards its click
// to the bound one, whose handlers decide by the width: a drawer below 992 px
// (pydata-sphinx-theme), a collapse above (sphinx-book-theme).
document.addEventListener("DOMContentLoaded", function () {
  [".primary-toggle", ".secondary-toggle"].forEach(function (selector) {
    var buttons = Array.prototype.slice.call(document.querySelectorAll(selector));
    var bound = buttons.shift();
    if (!bound) return;
    buttons.forEach(function (button) {
      button.addEventListener("click", function (event) {
        event.preventDefault();
        event.stopImmediatePropagation();
        bound.click();
      });
    });
  });
});

// On a phone the sidebars open as drawers (<dialog> elements, pydata-sphinx-theme). A tap on
// an entry used to leave its drawer open over the page: the contents drawer's entries are
// links within the page, so nothing closed it. Now a tapped link closes its drawer once the
// browser has followed it (the next task: the jump to the heading happens first).
document.addEventListener("DOMContentLoaded", function () {
  ["pst-primary-sidebar-modal", "pst-secondary-sidebar-modal"].forEach(function (id) {
    var drawer = document.getElementById(id);
    if (!drawer) return;
    drawer.addEventListener("click", function (event) {
      var link = event.target.closest ? event.target.closest("a[href]") : null;
      if (link && drawer.open) setTimeout(function () { drawer.close(); }, 0);
    });
  });
});

// Inline math wider than its line (a phone's) scrolls instead of being clipped: the formulas
// that overflow are marked once MathJax has typeset them, and again when the window resizes
// (js/site.css, span.math.kv-overflows).
document.addEventListener("DOMContentLoaded", function () {
  var mark = function () {
    document.querySelectorAll("span.math").forEach(function (span) {
      // what MathJax draws (its hidden copy for screen readers would count in scrollWidth)
      var math = span.querySelector("mjx-math");
      var wide = math && math.getBoundingClientRect().width > span.clientWidth + 1;
      span.classList.toggle("kv-overflows", !!wide);
    });
  };
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(mark);
    window.addEventListener("resize", mark);
  }
});
