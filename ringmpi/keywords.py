"""The score-modifier keywords of the public functions, made from the spec's fields.

``ring_attention``, ``ring_attention_backward`` and ``decode_attention`` take every
score modifier of :class:`ringmpi.spec.AttentionSpec` (the fields marked with
``_modifier`` metadata: ``alibi_slopes``, ``softcap``, ``sinks``) as a keyword
argument with default None. Rather than each function listing them (and
their documentation) by hand, :func:`spec_keywords` gives a function written
with ``**modifiers`` one keyword-only parameter per modifier field: in its
signature (``help()``, ``inspect.signature``, the API reference) and in its
docstring, where a line ``{modifiers}`` stands. A new modifier field is then a
keyword of all three with no edit here or there. An unknown keyword is the
``TypeError`` Python gives.
"""

from __future__ import annotations

import functools
import inspect
import textwrap

from .spec import modifier_fields

__all__ = ["spec_keywords", "modifier_doc"]

PLACEHOLDER = "{modifiers}"


def modifier_doc(indent: str = "    ") -> str:
    """The numpydoc Parameters entries of the modifier fields, indented by ``indent``."""
    lines = []
    for name, meta in modifier_fields():
        lines.append(f"{indent}{name} : {meta['kind']}")
        body = textwrap.wrap(meta["doc"], width=88 - len(indent) - 4)
        lines.extend(f"{indent}    {b}" for b in body)
    return "\n".join(lines)


def spec_keywords(fn):
    """Give ``fn`` (written with ``**modifiers``) one keyword per score-modifier field.

    The keywords go before the private ones (names starting with ``_``), each
    with default None; ``fn`` receives the given ones in ``modifiers``. The
    docstring line ``{modifiers}`` becomes their Parameters entries.
    """
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{fn.__name__} must end with **modifiers")
    rest = params[:-1]
    at = next((i for i, p in enumerate(rest) if p.name.startswith("_")), len(rest))
    mods = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
            for name, _ in modifier_fields()]  # fmt: skip
    new = sig.replace(parameters=rest[:at] + mods + rest[at:])
    allowed = frozenset(new.parameters)
    names = frozenset(m.name for m in mods)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for key in kwargs:
            if key not in allowed:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {key!r}")
        return fn(*args, **kwargs)

    wrapper.__signature__ = new
    wrapper.modifier_names = names
    doc = fn.__doc__ or ""
    line = next((ln for ln in doc.splitlines() if ln.strip() == PLACEHOLDER), None)
    if line is not None:
        indent = line[: len(line) - len(line.lstrip())]
        wrapper.__doc__ = doc.replace(line, modifier_doc(indent), 1)
    return wrapper
