"""kvtier.integrations imports one way: each module imports only the package's modules this
table allows (python/kvtier/integrations/__init__.py says the rule in words). Read from the
source with ast, so it needs no build."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "kvtier" / "integrations"

#: module -> the modules of kvtier.integrations it may import.
ALLOWED = {
    # the parts: no module of the package
    "config": set(),
    "plan": set(),
    "kv_layouts": set(),
    "request_keys": set(),
    "_vllm_standin": set(),
    "_sglang_standin": set(),  # SGLang's HiCache storage interface (issue 29); no module of the package
    "vllm_plugin": set(),  # names "kvtier.integrations.vllm" as a string; vLLM imports it
    # the sides and what reads vLLM's objects
    "scheduler_side": {"config", "plan", "request_keys"},
    "worker_side": {"config", "plan", "kv_layouts"},
    "vllm_base": {"_vllm_standin"},
    "vllm_config": {"config", "vllm_base"},
    "vllm_scheduler_output": {"plan"},
    "connector_stats": {"vllm_base"},
    # the adapters: the engine-independent facade and vLLM's connector
    "core": {"config", "plan", "kv_layouts", "scheduler_side", "worker_side"},
    "vllm": {
        "config",
        "plan",
        "kv_layouts",
        "request_keys",
        "scheduler_side",
        "worker_side",
        "vllm_base",
        "vllm_config",
        "vllm_scheduler_output",
        "connector_stats",
    },
    # SGLang's HiCache storage backend (issue 29): the host pool's layout, the backend
    "sglang_layouts": {"kv_layouts"},
    "sglang": {"_sglang_standin", "config", "sglang_layouts"},
    "__init__": set(),
}


def _imports(path: pathlib.Path) -> set:
    """The modules of kvtier.integrations that ``path`` imports (relative or absolute)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(a.name for a in node.names)
            elif node.level == 0 and (node.module or "").startswith("kvtier.integrations."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvtier.integrations."):
                    found.add(a.name.split(".")[2])
    return found


def test_every_module_of_the_package_is_in_the_table():
    assert {p.stem for p in PACKAGE.glob("*.py")} == set(ALLOWED)


def test_each_module_imports_only_what_the_table_allows():
    wrong = {}
    for name, allowed in ALLOWED.items():
        extra = _imports(PACKAGE / f"{name}.py") - allowed
        if extra:
            wrong[name] = sorted(extra)
    assert not wrong, f"imports the table does not allow (module: modules): {wrong}"


def test_the_table_has_no_cycle():
    state = {}

    def visit(name, path):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import cycle: {' -> '.join(path + [name])}"
        state[name] = "open"
        for dep in ALLOWED[name]:
            visit(dep, path + [name])
        state[name] = "done"

    for name in ALLOWED:
        visit(name, [])


def test_a_forbidden_import_is_found(tmp_path):
    bad = tmp_path / "plan.py"
    bad.write_text("from .worker_side import WorkerSide\nfrom kvtier.integrations.core import StepPlan\n")
    assert _imports(bad) == {"worker_side", "core"}
