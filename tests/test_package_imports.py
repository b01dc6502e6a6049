"""The package's import graph: no cycle (function-level imports included), and only the collectives
module imports torch.distributed. Read from the installed sources with ast, nothing imported."""
import ast
import pathlib

import fused_zero
import fused_zero.kernels

#: the modules that may import torch.distributed
DISTRIBUTED = {"fused_zero.comm.collectives"}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package (fused_zero.kernels ships from its own folder), by dotted name."""
    out = {}
    for root, name in ((pathlib.Path(fused_zero.__file__).parent, "fused_zero"),
                       (pathlib.Path(fused_zero.kernels.__file__).parent, "fused_zero.kernels")):
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            if rel[0] == "kernels" and name == "fused_zero":
                continue
            dotted = ".".join((name, *rel))
            out[dotted.removesuffix(".__init__")] = path
    return out


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(dotted: str, path: pathlib.Path, modules: dict) -> tuple[set[str], list[str]]:
    """(the package modules ``dotted`` imports anywhere in it, the torch.distributed imports it makes)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = dotted if path.name == "__init__.py" else dotted.rsplit(".", 1)[0]
    edges, distributed = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            distributed += [n for n in names if n.startswith("torch.distributed")]
            targets = names
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("torch.distributed") or (mod == "torch" and any(a.name == "distributed"
                                                                               for a in node.names)):
                distributed.append(mod)
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        if _type_checking_only(node, parents):
            continue
        edges |= {t for t in targets if t in modules and t != dotted}
    return edges, distributed


def _graph():
    modules = _modules()
    graph, distributed = {}, {}
    for dotted, path in modules.items():
        graph[dotted], distributed[dotted] = _imports(dotted, path, modules)
    return graph, distributed


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_package():
    graph, _ = _graph()
    assert {"fused_zero.optimizer", "fused_zero.comm.collectives", "fused_zero.sharding.partition",
            "fused_zero.tiers.store", "fused_zero.kernels.adamw", "fused_zero.checkpoint.save_load"} <= set(graph)
    assert "fused_zero.comm.collectives" in graph["fused_zero.comm.grad_sync"]


def test_no_import_cycle():
    graph, _ = _graph()
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_collectives_module_imports_torch_distributed():
    _, distributed = _graph()
    assert {m for m, found in distributed.items() if found} == DISTRIBUTED
