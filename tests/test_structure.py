"""The shape docs/structures.md promises, checked statically over ``ninfer/`` (issue 36): no
import cycle among the modules' top-level imports (``if TYPE_CHECKING:`` blocks aside; an import
inside a function is a deliberate late import), no private name imported from another module,
and no private attribute of another object read outside the module that defines it — except the
few listed here, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ninfer"

# (module, expression): private attributes read on something other than self / cls, allowed
ALLOWED_PRIVATE = {
    ("ninfer.actors.ray_actors", "os._exit"),                     # the standard library's exit without cleanup
    ("ninfer.benchmarks.speed_vllm", "os._exit"),                 # (vLLM's engine core outlives a normal exit)
    ("ninfer.native.model.fp8", "torch._scaled_mm"),              # torch's FP8 matmul has no public name
    ("ninfer.native.model.cpu_ops", "w.gate_up._version"),        # a tensor's in-place version counter (autograd's):
    ("ninfer.native.model.cpu_ops", "w.down._version"),           # no public name; keys a derived weight layout
    ("ninfer.native.kernels.compile_check", "compiler._seen"),    # triton's compiler internals (the check's subject)
    ("ninfer.native.kernels.compile_check", "driver._active"),
    ("ninfer.frontend.server", "refusal._replace"),               # NamedTuple's public API spells it so
    ("ninfer.actors.control", "old._finish"),                     # another ControlLoop: same class, same module
    ("ninfer.api", "handle._deliver"),                            # RequestHandle: same module
    ("ninfer.api", "handle._events"),
    ("ninfer.api", "handle._note"),
    ("ninfer.api", "self._engine._cancel"),                       # Engine: same module
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _top_level_imports(tree: ast.Module, mods: dict[str, Path], mod: str) -> set[str]:
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                continue
            if isinstance(n, ast.If):
                visit(n.body)
                visit(n.orelse)
            elif isinstance(n, ast.Try):
                visit(n.body)
                visit(n.orelse)
                for h in n.handlers:
                    visit(h.body)
            elif isinstance(n, ast.Import):
                found.update(a.name for a in n.names if a.name.startswith("ninfer"))
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("ninfer"):
                for a in n.names:
                    full = f"{n.module}.{a.name}"
                    found.add(full if full in mods else n.module)
    visit(tree.body)
    return {m for m in found if m in mods and m != mod}


def test_no_import_cycle_among_the_modules():
    mods = _modules()
    graph = {m: _top_level_imports(ast.parse(f.read_text()), mods, m) for m, f in mods.items()}
    state: dict[str, int] = {}                 # 1: on the path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := walk(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None
    for m in sorted(graph):
        if m not in state:
            cycle = walk(m)
            assert cycle is None, " -> ".join(cycle)


def test_no_private_name_of_another_module_is_used():
    mods = _modules()
    bad = []
    for mod, f in sorted(mods.items()):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("ninfer") and n.module != mod:
                bad += [f"{mod}: imports {n.module}.{a.name}" for a in n.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                owner = n.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if (mod, f"{ast.unparse(owner)}.{n.attr}") not in ALLOWED_PRIVATE:
                    bad.append(f"{mod}: reads {ast.unparse(owner)}.{n.attr}")
    assert not bad, "\n".join(bad)


def test_only_the_request_book_writes_a_requests_phase():
    """RequestBook.move is the controller's one writer of ``Request.phase`` (its transitions
    are checked there): no other assignment to a ``.phase`` in the controller or the policy."""
    bad = []
    for mod, f in sorted(_modules().items()):
        if not mod.startswith(("ninfer.engine", "ninfer.policy")) or mod == "ninfer.engine.books":
            continue
        for n in ast.walk(ast.parse(f.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
            bad += [f"{mod}:{n.lineno}: {ast.unparse(t)}" for t in targets
                    if isinstance(t, ast.Attribute) and t.attr == "phase"]
    assert not bad, "\n".join(bad)


def test_a_phase_transition_the_state_machine_lacks_is_refused():
    import pytest

    from ninfer.engine.books import TRANSITIONS, PhaseError, RequestBook
    from ninfer.engine.request import Request
    from ninfer.protocol import Phase

    req = Request.__new__(Request)
    req.rid = "r"
    for start, ends in TRANSITIONS.items():
        for end in Phase:
            req.phase = start
            if end in ends:
                RequestBook.move(req, end)
                assert req.phase is end
            else:
                with pytest.raises(PhaseError, match=f"{start.name} -> {end.name}"):
                    RequestBook.move(req, end)
                assert req.phase is start
    assert Phase.PAUSED in TRANSITIONS[Phase.RUNNING] and Phase.RUNNING not in TRANSITIONS[Phase.FINISHED]
