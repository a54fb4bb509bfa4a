// On a narrow screen (a phone), an equation or a table wider than the room it has is set in a smaller size that
// fits: MathJax 3 does not break lines, and a table's cells wrap only so far (sdpa_ref.css). Where it fits it
// keeps its size; equations are broken by hand (aligned) so that none needs this at 1280 px.
(function () {
  "use strict";
  var SELECTOR = ".bd-article mjx-container, .bd-article table";
  function measure(el) {
    var column = document.querySelector(".bd-article").getBoundingClientRect();
    if (el.tagName === "TABLE") {
      var box = el.closest(".pst-scrollable-table-container") || el;
      return [el.offsetWidth, box.parentElement.clientWidth];
    }
    var math = el.querySelector(":scope > mjx-math");     // not scrollWidth: the hidden MathML counts in it
    var r = (math || el).getBoundingClientRect();
    var room = column.right - r.left;                      // inline math: what is left of its line
    if (el.getAttribute("display") === "true") { room = Math.min(room, el.clientWidth); }
    return [r.width, room];
  }
  function fit() {
    if (!document.querySelector(".bd-article")) { return; }
    document.querySelectorAll(SELECTOR).forEach(function (el) { el.style.fontSize = ""; });
    document.querySelectorAll(SELECTOR).forEach(function (el) {
      // a table's padding and borders do not shrink with its text: a few passes
      for (var pass = 0; pass < 4; pass++) {
        var m = measure(el);
        if (!(m[1] > 0 && m[0] > m[1] + 0.5)) { break; }
        var size = parseFloat(getComputedStyle(el).fontSize);
        el.style.fontSize = (size * m[1] / m[0] * 0.97).toFixed(2) + "px";
      }
    });
  }
  window.addEventListener("load", function () {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) { MathJax.startup.promise.then(fit); } else { fit(); }
  });
  window.addEventListener("resize", fit);
})();
