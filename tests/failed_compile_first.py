"""A pytest plugin (``-p failed_compile_first``) that makes one ``torch.compile`` fail before the tests run: what a
test of a compile that fails on purpose leaves behind in its worker."""

from __future__ import annotations

import torch


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("a backend that fails on purpose")


def pytest_sessionstart(session) -> None:
    try:
        torch.compile(lambda x: x * 2, backend=_failing_backend)(torch.ones(3))
    except Exception as error:  # Dynamo wraps it
        assert "fails on purpose" in str(error)
    else:
        raise AssertionError("the compile did not fail")
