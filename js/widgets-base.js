// Glue between the vendored @jupyter-widgets/html-manager and this site. Loaded
// after require.js and before embed-amd.js (see nb_ipywidgets_js in _config.yml).
(function () {
  // 1. Tell require.js where the html-manager lives. embed-amd.js derives its
  //    webpack public path (where it fetches its icon fonts) from its module URL;
  //    without this it resolves relative to the page, e.g.
  //    book/@jupyter-widgets/html-manager/dist/*.woff2, which does not exist.
  var me = document.currentScript;
  if (me && typeof require !== "undefined" && require.config) {
    var base = me.src.slice(0, me.src.lastIndexOf("/"));
    require.config({ paths: { "@jupyter-widgets/html-manager/dist": base } });
  }
  // 2. The html-manager typesets widget labels with MathJax 2's MathJax.Hub.Queue;
  //    the site ships MathJax 3 (sphinx-mathjax-offline), which has no Hub. Give it
  //    a Hub whose Queue hands the element to MathJax 3. Registered before
  //    embed-amd.js's own listener, and deferred MathJax has loaded by then.
  document.addEventListener("DOMContentLoaded", function () {
    var mj = window.MathJax;
    if (!mj || mj.Hub) return;
    mj.Hub = {
      Queue: function (job) {
        var el = job && job[2], m = window.MathJax;
        if (!el || !m) return;
        var ready = m.startup && m.startup.promise ? m.startup.promise : Promise.resolve();
        ready.then(function () { return m.typesetPromise ? m.typesetPromise([el]) : null; })
             .catch(function (e) { console.warn("MathJax could not typeset a widget label", e); });
      },
    };
  });
})();
