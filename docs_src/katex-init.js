// Typeset the math that pymdownx.arithmatex (generic mode) leaves as \( \) and \[ \] in .arithmatex elements,
// with the KaTeX bundled in assets/katex/. `document$` is Material for MkDocs' page-load observable.
document$.subscribe(({ body }) => {
  for (const el of body.querySelectorAll(".arithmatex")) {
    renderMathInElement(el, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
    });  // a formula KaTeX cannot parse stays as TeX and is logged to the console, which dev/docs_check.py catches
  }
});
