"""Imports run one way (DESIGN.md): config -> weights / audio / sampling / kernels -> models -> inputs -> engine ->
api -> server -> cli, with no circle of files, and the scheduler and the HTTP protocol never import torch."""

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "q3tts"
LAYERS = ["config", ("weights", "audio", "sampling", "kernels", "invariant", "randomckpt", "hostcopy"), "models", "inputs",
          "engine",
          ("api", "align", "longform"),
          "server", ("cli", "cli_media", "cli_voices")]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in ((layer,) if isinstance(layer, str) else layer)}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """A file or a package of q3tts."""
    path = PKG.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path, typing: bool = False) -> set[str]:
    """Every q3tts module a file imports, at the top or inside a function (lazy imports count too; imports for
    type checkers only with `typing`)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If) and ast.unparse(t.test) == "TYPE_CHECKING"
                   for n in ast.walk(t)}  # `if TYPE_CHECKING:` imports never run
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("q3tts")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("q3tts"):
                # `from . import x` / `from .pkg import mod` may name modules: keep the ones that are files
                subs = {f"{target}.{a.name}" for a in node.names}
                out |= {s for s in subs if is_module(s)} or {target}
    return out - {mod}


def graph(typing: bool = False) -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    g = {m: {i for i in imports(p, typing) if i in files} for m, p in files.items()}
    g["q3tts"] = set()  # the package root re-exports TTS & co. lazily (module __getattr__): no import-time edge
    return g


def rank(module: str) -> int | None:
    parts = module.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None  # q3tts/__init__ (lazy re-exports) has no layer


def test_no_import_goes_up_a_layer():
    bad = []
    for mod, deps in graph().items():
        for dep in deps:
            if rank(mod) is not None and rank(dep) is not None and rank(dep) > rank(mod):
                bad.append(f"{mod} -> {dep}")
            if dep == "q3tts" and mod not in ("q3tts.inputs.voice", "q3tts.engine.artifact"):  # __version__ only
                bad.append(f"{mod} -> q3tts (the package root re-exports the api: import from the module)")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_the_api_and_the_server_use_the_engine_through_its_face():
    """q3tts.api and q3tts.server.* import the engine wing as `q3tts.engine` (its __init__'s exports), no module
    inside it."""
    bad = [f"{mod} -> {dep}" for mod, deps in graph(typing=True).items()
           if mod == "q3tts.api" or mod.startswith("q3tts.server")
           for dep in deps if dep.startswith("q3tts.engine.")]
    assert not bad, "imports past q3tts.engine's face:\n" + "\n".join(sorted(bad))


def test_no_circle_of_files():
    """Type-only imports (`if TYPE_CHECKING:`) count too: a circle of them is still a circle of files."""
    g = graph(typing=True)
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for d in g.get(m, ()):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in g:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layering_check_sees_lazy_and_relative_imports(tmp_path):
    # the checker itself: a lazy relative import inside a function is found and resolved
    f = PKG / "engine" / "runner.py"
    assert "q3tts.models.talker" in imports(f) and "q3tts.inputs.request" in imports(f)
    assert "q3tts.kernels" in imports(PKG / "sampling.py")  # `from . import kernels`: a package
    f = PKG / "engine" / "request.py"  # its one q3tts import is for type checkers
    assert "q3tts.inputs.request" in imports(f, typing=True) and "q3tts.inputs.request" not in imports(f)
    assert "q3tts.inputs.request" in imports(PKG / "inputs" / "voice.py")


def test_scheduler_and_protocol_import_no_torch():
    code = "import sys, q3tts.engine.scheduler, q3tts.engine.request, q3tts.server.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, check=True)
    assert out.stdout.strip() == "False"
