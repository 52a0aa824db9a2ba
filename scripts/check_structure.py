"""Check the import structure of stagemesh: its shared layers, its services and the application.

Usage: python scripts/check_structure.py [ROOT]   (default: the repository root)

Reads every module's imports from its syntax tree, so imports under `if TYPE_CHECKING:` and
inside functions count as much as those at the top. Prints the layer picture (one line per
package or stage service room: what it imports) and exits 1 when any rule is broken:

- no import cycle between modules;
- the shared layers (stagemesh.core, stagemesh.v1, stagemesh.weight_store) import no service
  and no application module (the rest of stagemesh: cli, launcher, supervisor, config, ...);
- stagemesh.core does not import stagemesh.weight_store;
- a service (stagemesh.gateway, stagemesh.stage_service, stagemesh.cache_service) imports no
  other service and no
  application module;
- inside stagemesh.stage_service, imports only go down the rooms in ROOMS; every module is in a room;
- nothing the base install runs (BASE_INSTALL: the gateway, the cache service, the client) imports,
  at any depth, a package that only the `stage` extra brings (STAGE_EXTRA: torch, ...);
- no Python file of the repository imports a service folder by its bare name (`gateway`,
  `stage_service`, `cache_service`): they are the packages stagemesh.gateway etc., and a bare
  import would load a second copy of their modules;
- stagemesh imports none of the repository's other code folders (OTHER_CODE: tests, the training
  scripts, ...): an installation does not have them.

The services' code lives in the repository's top-level folders (SOURCE_ROOTS); stagemesh/ holds
links to them, which this check does not follow, so each module is read once, under its
dotted name.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("stagemesh",)
# dotted package -> its folder under the repository root
SOURCE_ROOTS = {
    "stagemesh": "stagemesh",
    "stagemesh.gateway": "gateway",
    "stagemesh.stage_service": "stage_service",
    "stagemesh.cache_service": "cache_service",
}
BARE_SERVICE_NAMES = frozenset(name for name in SOURCE_ROOTS.values() if name != "stagemesh")
# folders of the repository whose Python files the bare-name rule reads besides SOURCE_ROOTS
OTHER_CODE = ("tests", "bench", "scripts", "training")
STAGE = "stagemesh.stage_service"
SERVICES = ("stagemesh.gateway", STAGE, "stagemesh.cache_service")
SHARED_TOP_DOWN = ("stagemesh.weight_store", "stagemesh.core", "stagemesh.v1")
SHARED = frozenset(SHARED_TOP_DOWN)
# the stage service's rooms, top first; one tuple is one tier (its rooms may import one another).
ROOMS: tuple[tuple[str, ...], ...] = (
    ("entry",),  # `stagemesh stage`: spawns the workers, then imports the server
    ("server", "control", "adapters", "metrics", "inputs"),
    ("engine",),
    ("executor",),
    ("worker",),
    ("models",),
    ("runtime_cache",),
    ("offload",),
    ("transport",),
    ("platform",),
    ("settings",),  # the stage's options: every room reads them
)
TIER = {room: tier for tier, rooms in enumerate(ROOMS) for room in rooms}
# `pip install stagemesh` without extras runs these; the stage's worker dependencies come with
# `stagemesh[stage]` (and the diffusers adapter's with `[diffusers]`).
BASE_INSTALL = ("stagemesh.gateway", "stagemesh.cache_service", "stagemesh.client")
STAGE_EXTRA = frozenset({"torch", "safetensors", "diffusers", "transformers", "accelerate", "peft"})


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int


def _python_files(folder: Path) -> Iterable[Path]:
    """Every .py file below `folder`, not entering linked folders (stagemesh/'s links to the
    service folders, read under their own root)."""
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        if path.is_symlink():
            continue
        if path.is_dir():
            yield from _python_files(path)
        elif path.suffix == ".py":
            yield path


def find_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of SOURCE_ROOTS under `root`."""
    modules = {}
    for package, folder in SOURCE_ROOTS.items():
        for path in _python_files(root / folder):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def bare_service_imports(root: Path) -> list[str]:
    """Imports of a service folder by its bare name anywhere in the repository's code."""
    found = []
    folders = [*SOURCE_ROOTS.values(), *OTHER_CODE]
    for path in (p for folder in folders for p in _python_files(root / folder)):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] in BARE_SERVICE_NAMES:
                    found.append(
                        f"{path.relative_to(root).as_posix()}:{node.lineno}: imports {name} by its bare name "
                        f"(import stagemesh.{name})"
                    )
    return found


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or the closest enclosing package that is one of ours (None: not ours)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported_names(module: str, path: Path, tree: ast.AST) -> Iterable[tuple[str, int]]:
    """Absolute names this module imports: `from X import y` gives X.y (a submodule, or an
    attribute of X; the caller resolves which)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            for alias in node.names:
                yield (origin if alias.name == "*" else f"{origin}.{alias.name}"), node.lineno


def find_imports(root: Path) -> tuple[dict[str, Path], list[Import], list[Import]]:
    """Our modules, the imports between them, and their imports of other distributions (the
    target is the top-level name: `torch` for `from torch.nn import functional`)."""
    modules = find_modules(root)
    imports, external = [], []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line in _imported_names(module, path, tree):
            target = _nearest_module(name, modules)
            if target is None and name.split(".")[0] not in PACKAGES:
                external.append(Import(module, name.split(".")[0], line))
            elif target is not None and target != module:
                imports.append(Import(module, target, line))
    return modules, imports, external


def cycles(modules: Iterable[str], imports: list[Import]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        edges[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(modules):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def group(module: str) -> str:
    """The unit of the layer picture: a shared layer, the application, a service, or a room."""
    for shared in SHARED:
        if _within(module, shared):
            return shared
    room = _room(module)
    if room is not None:
        return f"{STAGE}.{room}"
    service = _service(module)
    return service if service is not None else "stagemesh (application)"


def _service(module: str) -> str | None:
    return next((service for service in SERVICES if _within(module, service)), None)


def _room(module: str) -> str | None:
    """The stage service room a module is in (None: not below the stage service's package)."""
    if not module.startswith(STAGE + "."):
        return None
    return module[len(STAGE) + 1 :].partition(".")[0]


def _is_application(module: str) -> bool:
    return group(module) == "stagemesh (application)"


def violations(root: Path, modules: dict[str, Path], imports: list[Import]) -> list[str]:
    found = [f"import cycle: {' <-> '.join(c)}" for c in cycles(modules, imports)]
    for module in sorted(modules):
        room = _room(module)
        if room is not None and room not in TIER:
            found.append(f"{module}: {STAGE}.{room} is in no room of ROOMS")
    for imp in sorted(imports, key=lambda i: (i.source, i.line, i.target)):
        where = f"{modules[imp.source].relative_to(root).as_posix()}:{imp.line}: {imp.source} imports {imp.target}"
        source_group = group(imp.source)
        target_service = _service(imp.target)
        if source_group in SHARED and (target_service is not None or _is_application(imp.target)):
            found.append(f"{where} (the shared layers import no service or application module)")
        elif source_group == "stagemesh.core" and group(imp.target) == "stagemesh.weight_store":
            found.append(f"{where} (stagemesh.core is below stagemesh.weight_store)")
        source_service = _service(imp.source)
        if source_service is not None:
            if target_service is not None and target_service != source_service:
                found.append(f"{where} (one service imports another)")
            elif _is_application(imp.target):
                found.append(f"{where} (a service imports the application above it)")
        if source_service == STAGE == target_service:
            source_tier = TIER.get(_room(imp.source) or "", -1)
            target_tier = TIER.get(_room(imp.target) or "", -1)
            if 0 <= target_tier < source_tier:
                found.append(f"{where} (upward between stage service rooms)")
    return found


def base_install_violations(
    root: Path, modules: dict[str, Path], imports: list[Import], external: list[Import]
) -> list[str]:
    """Each module the base install reaches that imports a STAGE_EXTRA package, with the chain of
    imports that reaches it."""
    edges: dict[str, list[str]] = defaultdict(list)
    for imp in imports:
        edges[imp.source].append(imp.target)
    via: dict[str, str | None] = {m: None for m in modules if any(_within(m, r) for r in BASE_INSTALL)}
    todo = list(via)
    while todo:
        module = todo.pop()
        for target in edges[module]:
            if target not in via:
                via[target] = module
                todo.append(target)
    found = []
    for imp in sorted(external, key=lambda i: (i.source, i.line)):
        if imp.source in via and imp.target in STAGE_EXTRA:
            chain, at = [], imp.source
            while at is not None:
                chain.append(at)
                at = via[at]
            found.append(
                f"{modules[imp.source].relative_to(root).as_posix()}:{imp.line}: {imp.source} imports "
                f"{imp.target}, which only the stage extra installs; reached from the base install by "
                f"{' <- '.join(chain)}"
            )
    return found


def uninstalled_imports(root: Path, modules: dict[str, Path], external: list[Import]) -> list[str]:
    """Imports by stagemesh's modules of the repository's code folders outside the package."""
    return [
        f"{modules[imp.source].relative_to(root).as_posix()}:{imp.line}: {imp.source} imports {imp.target}, "
        "a folder of the repository that an installation does not have"
        for imp in sorted(external, key=lambda i: (i.source, i.line))
        if imp.target in OTHER_CODE
    ]


def _group_order(name: str) -> tuple[int, int, str]:
    """Top of the picture first: the application, the services (the stage service room by room),
    then the shared layers."""
    order = ["stagemesh (application)", "stagemesh.gateway", "stagemesh.cache_service", STAGE, *SHARED_TOP_DOWN]
    room_name = _room(name)
    top = STAGE if room_name is not None else name
    room = TIER.get(room_name, len(ROOMS)) if room_name is not None else -1
    return (order.index(top) if top in order else len(order), room, name)


def layer_picture(modules: dict[str, Path], imports: list[Import]) -> list[str]:
    uses: dict[str, set[str]] = {group(m): set() for m in modules}
    for imp in imports:
        if group(imp.target) != group(imp.source):
            uses[group(imp.source)].add(group(imp.target))
    width = max(len(name) for name in uses)
    return [
        f"{name:<{width}} -> {', '.join(sorted(uses[name], key=_group_order)) or '(nothing of ours)'}"
        for name in sorted(uses, key=_group_order)
    ]


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else REPO
    modules, imports, external = find_imports(root)
    print("\n".join(layer_picture(modules, imports)))
    found = (
        violations(root, modules, imports)
        + base_install_violations(root, modules, imports, external)
        + bare_service_imports(root)
        + uninstalled_imports(root, modules, external)
    )
    if found:
        print(f"\n{len(found)} structure violation(s):")
        print("\n".join(f"  {line}" for line in found))
        return 1
    print(f"\n{len(modules)} modules, {len(imports)} imports between them: no violation")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
