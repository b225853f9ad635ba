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
