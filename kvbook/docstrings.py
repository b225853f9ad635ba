"""The kvlib reference's docstrings, linked (issue 44): a name a docstring writes as code
links to its entry when it means one documented kvlib object, read where it is written.

Used by `kvbook.apiref` at ``doctree-resolved``; split from it to keep each module to
one idea. Single backticks in docstrings are code (``default_role`` literal, set by apiref),
so a name that means nothing documented (a parameter, ``x``, ``torch.Tensor``) stays code,
never italics and never a broken link.
"""

from __future__ import annotations

import re

NAME = re.compile(r"^([A-Za-z_][\w.]*)(\(.*\))?$")


def link_docstrings(app, doctree, docname: str) -> None:
    """A reference page: each name its docstrings write as code (`x` or ``x``) links to its
    entry when it means one documented kvlib object, read where it is written (`_target`)."""
    from docutils import nodes
    from sphinx import addnodes

    env = app.builder.env
    objects = env.get_domain("py").objects
    # a module's constant by its bare name (`PRESETS`, `FULL`) where only one module has it
    constants: dict[str, set[str]] = {}
    for full, entry in objects.items():
        if entry.objtype == "data" and full.rpartition(".")[2][:1].isupper():
            constants.setdefault(full.rpartition(".")[2], set()).add(full)
    names = {bare: fulls.pop() for bare, fulls in constants.items() if len(fulls) == 1}
    names.update(env.kvlib_aliases)
    module, found = None, []
    for node in doctree.findall(nodes.Element):  # in document order: a module's section, then its text
        module = next((i[len("module-"):] for i in node.get("ids", ()) if i.startswith("module-")), module)
        if (isinstance(node, nodes.literal) and not isinstance(node.parent, nodes.reference)
                and not any(isinstance(a, addnodes.desc_signature) for a in _ancestors(node))):
            found.append((node, module))
    for lit, module in found:
        m = NAME.match(lit.astext().strip())
        full = m and _target(m.group(1), lit, module, objects, names)
        if not full:
            continue
        entry = objects[full]
        uri = app.builder.get_relative_uri(docname, entry.docname) + "#" + entry.node_id
        ref = nodes.reference("", "", internal=True, refuri=uri, reftitle=full)
        lit.replace_self(ref)
        lit["classes"] += ["xref", "py", "py-obj"]  # as Sphinx marks a cross-reference's code
        ref += lit


def _ancestors(node):
    while node.parent is not None:
        node = node.parent
        yield node


def _target(name: str, lit, module: str | None, objects: dict, aliases: dict[str, str]) -> str | None:
    """The documented object a docstring's name means, or None (it stays code).

    Read as Python reads a name where it is written: a member of the entry's own class
    (``step`` in PagedCache's docstrings), then of its module, then a full or unambiguous name
    (``aliases``: `_aliases`' ``kvlib.memory``, ``PagedCache.step``, ``PagedCache``, and a
    module's constant by its bare name, ``PRESETS``). A parameter of the
    entry's own signature is a parameter, not the kvlib object that shares its name (``cache``,
    ``press``); in a class's docstring its fields come first (a dataclass's ``top_k``).
    """
    from sphinx import addnodes

    desc = next((a for a in _ancestors(lit) if isinstance(a, addnodes.desc)), None)
    sig = next(iter(desc.findall(addnodes.desc_signature)), None) if desc is not None else None
    local, params, is_class = [], set(), False
    if sig is not None:
        module, fullname = sig.get("module") or module, sig.get("fullname", "")
        is_class = desc.get("objtype") in ("class", "exception")
        owner = fullname if is_class else fullname.rpartition(".")[0]
        local += [f"{module}.{owner}.{name}"] if owner else []
        for param in sig.findall(addnodes.desc_parameter):
            first = next(iter(param.findall(addnodes.desc_sig_name)), None)
            params.add(first.astext() if first is not None else "")
    local += [f"{module}.{name}"] if module else []
    if name in params and not is_class:
        return None
    for full in local:  # by aliases first: in kvlib's own docstring `attention` is the function it exports
        found = aliases.get(full) or (full if full in objects else None)
        if found:
            return found
    if name in params:
        return None
    return aliases.get(name) or (name if name in objects else None)
