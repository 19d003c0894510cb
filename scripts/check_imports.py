"""Check that fastbert's imports run downward: report every module importing one of a higher layer,
and every import cycle. Lazy (function-level) imports count too: they are arrows all the same.

Layers, bottom to top (a module may import its own layer and those below):
    errors (and the leaf utilities io, textio, lazy) < config, ops, padding < tokenization, data
    < model, encoder_fn, hf, heads, hf_patch, padding_rows < training, tasks, analysis, sentence_embeddings
    < commands < cli

    python3 scripts/check_imports.py        # exit status 1 when an arrow runs up or a cycle exists
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fastbert"
LAYERS = [
    {"errors", "io", "textio", "lazy"},
    {"config", "ops", "padding"},
    {"tokenization", "data"},
    {"model", "encoder_fn", "hf", "heads", "hf_patch", "padding_rows"},
    {"training", "tasks", "analysis", "sentence_embeddings"},
    {"commands"},
    {"cli", "__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else None
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return None


def imports(path: Path, modules: set[str]) -> set[str]:
    """The fastbert modules ``path`` imports (``from fastbert.x import y`` counts fastbert.x.y when y is one)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:  # a submodule when it is one, else the module the name lives in
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    out = set()
    for target in found:
        while target and target not in modules:  # fastbert.tokenization.base.load_vocab -> its module
            target = target.rpartition(".")[0]
        if target and target != name and target != "fastbert":
            out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports(p, modules) for p in paths}
    problems = 0
    for source in sorted(graph):
        for target in sorted(graph[source]):
            ls, lt = layer(source), layer(target)
            if ls is not None and lt is not None and lt > ls:
                print(f"upward: {source} (layer {ls}) imports {target} (layer {lt})")
                problems += 1
    for component in cycles(graph):
        print("cycle: " + " <-> ".join(component))
        problems += 1
    unplaced = sorted(m for m in modules if m != "fastbert" and layer(m) is None)
    if unplaced:
        print("not in a layer: " + ", ".join(unplaced))
    print(f"{len(modules)} modules, {problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
