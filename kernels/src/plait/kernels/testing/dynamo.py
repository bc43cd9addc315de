"""What ``torch.compile`` did to a model, for the compile tests of every package: where dynamo broke
the graph, whether it was inside a transformer block, and how many graphs it compiled.

Graph breaks are read from dynamo's ``graph_breaks`` log (the place each break was reported, a
file and a line of user code) and from its counters (the reasons); graphs from
``counters["stats"]["unique_graphs"]``. A break "inside a block" is one reported at a line of the
``forward`` of a module class the block holds, or of a function the caller names (an attention
function registered with HF's ``AttentionInterface`` runs inside the block without being a module).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator

import torch

_BREAK_AT = re.compile(r"in user code at (\S+):(\d+)")
_BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"

Span = tuple[str, int, int]


@contextlib.contextmanager
def graph_break_sites() -> Iterator[list[tuple[str, int]]]:
    """Record (file, line) of every graph break dynamo reports inside the scope, without printing it.

    Yields:
        The list the sites are appended to, in the order dynamo reported them.
    """
    found: list[tuple[str, int]] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            match = _BREAK_AT.search(record.getMessage())
            if match:
                found.append((match.group(1), int(match.group(2))))

    torch._logging.set_logs(graph_breaks=True)
    logger = logging.getLogger(_BREAK_LOGGER)
    handler, propagate = Handler(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False  # recorded, not printed
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        torch._logging.set_logs()


def code_spans(block: torch.nn.Module, functions: Iterable[Callable] = ()) -> list[Span]:
    """(file, first line, last line) of the ``forward`` of every module class in ``block`` and of ``functions``.

    Args:
        block: one transformer block (a decoder layer).
        functions: more code that runs inside the block (e.g. a registered attention function).

    Returns:
        The spans, sorted.
    """
    code = {type(module).forward for module in block.modules()} | set(functions)
    spans = set()
    for function in code:
        function = inspect.unwrap(function)
        lines, first = inspect.getsourcelines(function)
        spans.add((inspect.getsourcefile(function), first, first + len(lines) - 1))
    return sorted(spans)


def file_spans(*modules: object) -> list[Span]:
    """Spans covering the whole source file of each module (code a block calls into, e.g. an
    attention function and the collectives under it).

    Args:
        modules: imported Python modules.

    Returns:
        One span per module.
    """
    return [(inspect.getsourcefile(module), 1, 1 << 30) for module in modules]


def breaks_inside(sites: Iterable[tuple[str, int]], spans: Iterable[Span]) -> list[tuple[str, int]]:
    """The break sites that fall at a line of ``spans`` (see :func:`code_spans`).

    Args:
        sites: from :func:`graph_break_sites`.
        spans: from :func:`code_spans`.

    Returns:
        The sites inside a span, in order.
    """
    spans = list(spans)
    return [(path, line) for path, line in sites
            if any(path == source and first <= line <= last for source, first, last in spans)]


def graph_count() -> int:
    """Graphs dynamo has compiled since its counters were last cleared."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def break_reasons() -> list[str]:
    """The reasons of the graph breaks dynamo has counted since its counters were last cleared."""
    return list(torch._dynamo.utils.counters["graph_break"])
