import doctest
import importlib

import pytest


# importlib: `sdpa_ref.softmax` the attribute is the function, not the module
@pytest.mark.parametrize("name", ["sdpa_ref.softmax", "sdpa_ref.masks", "sdpa_ref.alibi", "sdpa_ref.diagnostics",
                                  "sdpa_ref.second_order"])
def test_docstring_examples(name):
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
