"""The gallery's matplotlib scraper, with plain-text alt text.

sphinx-gallery makes an image's alt text from the figure's titles, which
hold matplotlib's TeX (``softmax$(QK^T/\\sqrt{d_k})$``); a screen reader, or a
reader whose image does not load, would get the TeX raw.
"""

import re

_COMMANDS = {"sqrt": "sqrt", "top": "T", "|": "|", "cdot": "*", "times": "x", "approx": "~", "le": "<=",
             "ge": ">=", "infty": "inf", "ldots": "...", "dots": "..."}


def plain_text(tex):
    """matplotlib mathtext made plain text: ``$d_k$`` -> ``d_k``, ``\\sqrt{d_k}`` -> ``sqrt(d_k)``."""
    def math(m):
        t = m.group(1)
        t = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", t)
        t = re.sub(r"\\(mathrm|mathbf|mathsf|mathit|text|operatorname)\{([^{}]*)\}", r"\2", t)
        t = re.sub(r"\\([A-Za-z]+|\|)", lambda c: _COMMANDS.get(c.group(1), c.group(1)), t)
        t = re.sub(r"\\[,;:! ]", " ", t)
        return t.replace("{", "").replace("}", "")
    return re.sub(r"\$([^$]*)\$", math, tex)


def matplotlib_plain_alt(block, block_vars, gallery_conf, **kwargs):
    """sphinx-gallery's matplotlib scraper, its ``:alt:`` lines made plain text (see :func:`plain_text`)."""
    from sphinx_gallery.scrapers import matplotlib_scraper   # here: plain_text needs no docs extra

    rst = matplotlib_scraper(block, block_vars, gallery_conf, **kwargs)
    return re.sub(r"(:alt: )(.*)", lambda m: m.group(1) + plain_text(m.group(2)), rst)
