"""Import cycles in the staleflow package, read in its installed layout (run through .ci/import-cycles).

Every import counts, at any depth of a module (function-level and ``TYPE_CHECKING`` imports too):
a cycle is a cycle to a reader of the code even where Python happens to resolve it. Cycles are
reported between modules and between rooms (a subpackage of staleflow, or a module at its top level),
which is how the layers are drawn. Exits 1 if there is any."""

from __future__ import annotations

import sys

import grimp


def room_of(module: str) -> str:
    """``staleflow.servers.params.store`` -> ``staleflow.servers``; a top-level module is its own room."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; only components of more than one node (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    found.append(sorted(component))
    return found


def main() -> int:
    graph = grimp.build_graph("staleflow", include_external_packages=False)
    modules = set(graph.modules)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & modules for m in modules}
    rooms: dict[str, set[str]] = {}
    for module, imported in edges.items():
        rooms.setdefault(room_of(module), set()).update(room_of(i) for i in imported if room_of(i) != room_of(module))
    failed = False
    for kind, nodes, arrows in (("modules", modules, edges), ("rooms", set(rooms), rooms)):
        for component in strongly_connected(nodes, arrows):
            failed = True
            print(f"import cycle between {kind}: {' , '.join(component)}")
            for member in component:
                inside = sorted(i for i in arrows.get(member, ()) if i in component)
                if kind == "modules":
                    for target in inside:
                        lines = graph.get_import_details(importer=member, imported=target)
                        where = ", ".join(f"line {d['line_number']}" for d in lines)
                        print(f"  {member} -> {target} ({where})")
                else:
                    print(f"  {member} -> {', '.join(inside)}")
    if not failed:
        print(f"no import cycles among {len(modules)} modules in {len(rooms)} rooms")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
