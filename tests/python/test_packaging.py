"""The package as Python users install it (pyproject.toml, setup.py; docs/python.md).

Two kinds of tests:

* the launchers (``kvtier.server``, ``kvtier.cli``) and the vLLM plugin
  (``kvtier.integrations.vllm_plugin``) against the build tree's package, in this process or
  a child: no build;
* ``packaging``: a copy of the checkout (its tracked and untracked, not ignored, files: what a
  fresh clone of this tree would hold) installed with ``pip install --no-build-isolation`` into
  a venv with the system's site-packages, then ``pip wheel`` and the sdist of that copy. It
  is one CMake configure and build of the extension and kvtier-server in the copy's
  ``build-pip-cpython-3XX/``: with ccache warm from build/ (scripts/test.sh sets
  CCACHE_BASEDIR; this sets it for the copy) its compiles are hits and the whole module takes
  ~20-40 s; cold, the two compiles take a few minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path
from typing import Dict, List

import pytest

import kvtier
from kvtier import _programs
from kvtier.integrations import vllm_plugin
from kvtier_testing import ServerFactory

REPO = Path(__file__).resolve().parents[2]
#: The build whose python/ the suite imports (conftest.py): <build>/python/kvtier/__init__.py.
BUILD_DIR = Path(os.path.abspath(kvtier.__file__)).parents[2]

#: vLLM's KVConnectorFactory as a plugin sees it (vllm/distributed/kv_transfer/kv_connector/
#: factory.py at the pinned commit and since): name -> lazy loader, ValueError on a duplicate.
FACTORY_STANDIN = '''
import importlib

class KVConnectorFactory:
    _registry = {}

    @classmethod
    def register_connector(cls, name, module_path, class_name):
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader():
            module = importlib.import_module(module_path)
            return getattr(module, class_name)

        cls._registry[name] = loader
'''

FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"


def factory_standin_modules(source):
    """The modules vllm ... kv_connector.factory, the last one running ``source``: for
    sys.modules. The packages have no submodules, so ``import vllm.<anything else>`` fails
    as without vLLM (the connector then uses its own stand-in base classes)."""
    import types

    parts = "vllm.distributed.kv_transfer.kv_connector.factory".split(".")
    modules = {}
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = types.ModuleType(name)
        if i < len(parts):
            module.__path__ = []
        modules[name] = module
    exec(source, modules[".".join(parts)].__dict__)
    return modules


def standin_factory(monkeypatch, source=FACTORY_STANDIN):
    modules = factory_standin_modules(source)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules[FACTORY_MODULE].KVConnectorFactory


# --- the vLLM plugin --------------------------------------------------------------------------


def test_plugin_registers_the_connector_with_vllms_factory(monkeypatch):
    factory = standin_factory(monkeypatch)
    vllm_plugin.register()
    assert list(factory._registry) == ["KVTierConnector"]
    cls = factory._registry["KVTierConnector"]()
    from kvtier.integrations.vllm import KVTierConnector

    assert cls is KVTierConnector


def test_plugin_registers_twice_without_error(monkeypatch):
    """vLLM loads plugins once per process, but a process may load them again (and the factory
    raises on a duplicate name): the second call keeps the first registration."""
    factory = standin_factory(monkeypatch)
    vllm_plugin.register()
    first = factory._registry["KVTierConnector"]
    vllm_plugin.register()
    assert factory._registry["KVTierConnector"] is first


def test_plugin_keeps_a_registration_made_elsewhere(monkeypatch):
    factory = standin_factory(monkeypatch)
    factory.register_connector("KVTierConnector", "somewhere.else", "KVTierConnector")
    theirs = factory._registry["KVTierConnector"]
    vllm_plugin.register()
    assert factory._registry["KVTierConnector"] is theirs


def test_plugin_with_a_factory_without_registry_attribute(monkeypatch):
    """A factory that keeps its registry elsewhere and raises ValueError on a duplicate."""
    source = FACTORY_STANDIN.replace("_registry", "_connectors")
    factory = standin_factory(monkeypatch, source)
    vllm_plugin.register()
    vllm_plugin.register()
    assert list(factory._connectors) == ["KVTierConnector"]


def test_plugin_without_vllm_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm...` raises ImportError
    assert vllm_plugin.register() is None


# --- the launchers ----------------------------------------------------------------------------


def run_python(args: List[str], env: Dict[str, str] = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(BUILD_DIR / "python"), **(env or {})}, **kw)


def test_launchers_of_a_build_tree_say_where_the_program_is():
    """The build tree's package has no kvtier/bin/: a clear error, exit 127, and the program's
    path in the build."""
    server = run_python(["-m", "kvtier.server", "--help"])
    assert server.returncode == _programs.EXIT_NOT_BUNDLED, server
    assert server.stdout == ""
    assert f"has no bundled kvtier-server program ({BUILD_DIR}/python/kvtier/bin/kvtier-server is missing)" \
        in server.stderr
    if (BUILD_DIR / "examples" / "kvtier-server").is_file():
        assert f"run {BUILD_DIR}/examples/kvtier-server instead" in server.stderr
    cli = run_python(["-m", "kvtier.cli", "status"])
    assert cli.returncode == _programs.EXIT_NOT_BUNDLED, cli
    assert "has no bundled kvtier program" in cli.stderr


def test_launcher_execs_the_program_with_the_arguments(tmp_path):
    """The program replaces the Python process (same pid) with argv as given, and its exit
    status is the launcher's."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "kvtier-server"
    fake.write_text('#!/bin/sh\necho "pid $$"\nfor a in "$@"; do echo "arg [$a]"; done\nexit 7\n')
    fake.chmod(0o755)
    code = ("import os, pathlib, sys; import kvtier._programs as p; p.BIN_DIR = pathlib.Path(sys.argv.pop(1)); "
            "print('pid', os.getpid(), flush=True); from kvtier.server import main; main()")
    r = run_python(["-c", code, str(tmp_path / "bin"), "--socket", "/tmp/a b.sock", "", "--l1-size-gb=4"])
    assert r.returncode == 7, r
    lines = r.stdout.splitlines()
    assert lines[0] == lines[1], "the program runs in the launcher's process"
    assert lines[2:] == ["arg [--socket]", "arg [/tmp/a b.sock]", "arg []", "arg [--l1-size-gb=4]"]


def test_version_is_version_hpp():
    """setup.py reads include/kvtier/version.hpp, whose version_string the extension reports."""
    spec = importlib.util.spec_from_file_location("kvtier_setup", REPO / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # __name__ is not __main__: setup() does not run
    assert setup_py.kvtier_version() == kvtier.__version__


@pytest.mark.parametrize("cmake_version, wanted", [(None, ["cmake>=3.25"]), ("3.22.1", ["cmake>=3.25"]),
                                                    ("3.25.1", []), ("4.1.0", [])])
def test_build_backend_asks_for_cmake_only_without_a_usable_one(monkeypatch, tmp_path, cmake_version, wanted):
    """An isolated build (`pip install .` with an index) gets pip's cmake package only where
    PATH has no CMake >= 3.25 (CMakeLists.txt's minimum)."""
    if cmake_version is not None:
        fake = tmp_path / "cmake"
        fake.write_text(f"#!/bin/sh\necho 'cmake version {cmake_version}'\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    spec = importlib.util.spec_from_file_location("kvtier_build_backend",
                                                  REPO / "python" / "build_backend" / "kvtier_build_backend.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    assert backend._cmake_requirement() == wanted
    assert "cmake_minimum_required(VERSION 3.25" in (REPO / "CMakeLists.txt").read_text()


# --- pip install / pip wheel / sdist of a copy of the checkout --------------------------------


def copy_checkout(dest: Path) -> Path:
    """The tree's tracked and untracked-but-not-ignored files (a fresh clone of the working
    tree as it is, uncommitted edits included), into dest."""
    r = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True)
    assert r.returncode == 0, f"the packaging tests copy the checkout with git ls-files: {r.stderr.decode()}"
    listed = r.stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if not os.path.lexists(src):  # deleted, not yet committed
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)
    return dest


def build_env(source: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CMAKE_ARGS", "KVTIER_CMAKE_BUILD_DIR")}
    # Compiles relative to the source (as build/'s with scripts/test.sh's CCACHE_BASEDIR): hits.
    env["CCACHE_BASEDIR"] = str(source)
    env.setdefault("CCACHE_SLOPPINESS", "pch_defines,time_macros,include_file_mtime,include_file_ctime")
    return env


def run(command: List[str], env: Dict[str, str] = None, cwd: Path = None, timeout: float = 1200) -> str:
    r = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, command))} exited {r.returncode}:\n{r.stdout[-6000:]}\n{r.stderr[-4000:]}"
    return r.stdout


PIP_OFFLINE = ["--no-build-isolation", "--no-index", "--no-cache-dir", "--disable-pip-version-check"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv (system site-packages: Debian's setuptools, wheel, numpy, torch) into which
    `pip install --no-build-isolation` installed a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = copy_checkout(tmp / "kvtier")
    venv = tmp / "venv"
    run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv])
    run([venv / "bin" / "python", "-m", "pip", "install", *PIP_OFFLINE, source], env=build_env(source), cwd=tmp)
    return {"tmp": tmp, "source": source, "venv": venv, "python": venv / "bin" / "python"}


def venv_python(installed, code: str) -> str:
    """Runs code with the venv's python, away from the tree (cwd: the temp dir, no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return run([installed["python"], "-c", code], env=env, cwd=installed["tmp"], timeout=120)


def site_packages(installed) -> Path:
    return Path(venv_python(installed, "import sysconfig; print(sysconfig.get_path('platlib'))").strip())


def cli_expected() -> bool:
    """Whether the checkout has the operator CLI's CMake target (then the wheel bundles it)."""
    return any("add_executable(kvtier-cli" in p.read_text() for p in (REPO / "examples").rglob("CMakeLists.txt"))


@pytest.mark.packaging
def test_pip_install_imports_kvtier_from_the_venv(installed):
    out = json.loads(venv_python(installed, "import json, kvtier, kvtier.integrations.vllm as v; "
                                            "print(json.dumps([kvtier.__file__, kvtier.__version__, v.__file__]))"))
    package = site_packages(installed) / "kvtier"
    assert out == [str(package / "__init__.py"), kvtier.__version__, str(package / "integrations" / "vllm.py")]
    # the stubs, and the extension, where type checkers and the importer look
    assert (package / "_kvtier.pyi").read_text() == (REPO / "python" / "kvtier" / "_kvtier.pyi").read_text()
    assert (package / "py.typed").is_file()
    assert len(list(package.glob("_kvtier.cpython-*.so"))) == 1
    meta = json.loads(venv_python(installed, "import json; from importlib import metadata as m; "
                                             "print(json.dumps([m.version('kvtier'), [str(f) for f in m.files('kvtier')]]))"))
    assert meta[0] == kvtier.__version__
    assert {"kvtier/_kvtier.pyi", "kvtier/py.typed", "kvtier/bin/kvtier-server"} <= set(meta[1])


@pytest.mark.packaging
def test_pip_install_kvtier_server_runs_the_bundled_server(installed, tmp_path):
    bin_dir = installed["venv"] / "bin"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for command in ([bin_dir / "kvtier-server", "--help"], [installed["python"], "-m", "kvtier.server", "--help"]):
        out = run(command, env=env, cwd=installed["tmp"], timeout=60)
        assert out.startswith("kvtier-server: the kvtier cache server"), out
        assert "--socket" in out and "--l1-size-gb" in out
    # A user without a server: the console script serves (the launcher execs: the pid is
    # the server's; SIGTERM stops it with status 0).
    servers = ServerFactory(bin_dir / "kvtier-server", tmp_path)
    try:
        server = servers.start()
        assert server.status()["version"] == kvtier.__version__
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
    finally:
        servers.close()


@pytest.mark.packaging
def test_pip_install_kvtier_cli(installed):
    bundled = site_packages(installed) / "kvtier" / "bin" / "kvtier"
    r = subprocess.run([installed["venv"] / "bin" / "kvtier", "--help"], capture_output=True, text=True, timeout=60,
                       cwd=installed["tmp"])
    if cli_expected():
        assert bundled.is_file() and r.returncode == 0, r
    else:
        assert not bundled.exists()
        assert r.returncode == _programs.EXIT_NOT_BUNDLED, r
        assert "has no bundled kvtier program" in r.stderr


@pytest.mark.packaging
def test_pip_install_registers_the_vllm_plugin(installed):
    """The entry point is in the installed metadata and resolves to the function that
    registers KVTierConnector -> kvtier.integrations.vllm.KVTierConnector (vLLM's factory
    a stand-in in sys.modules)."""
    code = "\n".join([
        "import json, sys",
        inspect.getsource(factory_standin_modules),
        f"sys.modules.update(factory_standin_modules({FACTORY_STANDIN!r}))",
        "from importlib.metadata import entry_points",
        "eps = entry_points(group='vllm.general_plugins')",
        "mine = [ep for ep in eps if ep.value.startswith('kvtier.')]",
        "register = mine[0].load()",
        "register(); register()",
        f"factory = sys.modules[{FACTORY_MODULE!r}].KVConnectorFactory",
        "cls = factory._registry['KVTierConnector']()",
        "scripts = sorted((ep.name, ep.value) for ep in entry_points(group='console_scripts') "
        "if ep.value.startswith('kvtier.'))",
        "print(json.dumps({'plugins': [(ep.name, ep.value) for ep in mine], 'class': [cls.__module__, cls.__name__],",
        "                  'file': sys.modules[cls.__module__].__file__, 'registry': list(factory._registry),",
        "                  'scripts': scripts}))",
    ])
    out = json.loads(venv_python(installed, code))
    assert out["plugins"] == [["kvtier", "kvtier.integrations.vllm_plugin:register"]]
    assert out["class"] == ["kvtier.integrations.vllm", "KVTierConnector"]
    assert out["file"] == str(site_packages(installed) / "kvtier" / "integrations" / "vllm.py")
    assert out["registry"] == ["KVTierConnector"]
    assert out["scripts"] == [["kvtier", "kvtier.cli:main"], ["kvtier-server", "kvtier.server:main"]]


def wheel_names(wheel: Path) -> Dict[str, int]:
    """name -> unix mode of each file in the wheel."""
    with zipfile.ZipFile(wheel) as z:
        return {i.filename: i.external_attr >> 16 for i in z.infolist()}


def check_wheel(wheel: Path) -> Dict[str, int]:
    version = kvtier.__version__
    assert wheel.name.startswith(f"kvtier-{version}-cp{sys.version_info[0]}{sys.version_info[1]}-"), wheel.name
    assert wheel.name.endswith(f"-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}.whl"), wheel.name
    names = wheel_names(wheel)
    for f in ("kvtier/__init__.py", "kvtier/_kvtier.pyi", "kvtier/py.typed", "kvtier/server.py", "kvtier/cli.py",
              "kvtier/integrations/vllm.py", "kvtier/integrations/vllm_plugin.py", "kvtier/bin/kvtier-server"):
        assert f in names, f"{f} not in {wheel.name}"
    assert [n for n in names if n.startswith("kvtier/_kvtier.cpython-") and n.endswith(".so")]
    assert names["kvtier/bin/kvtier-server"] & stat.S_IXUSR, "the server is executable"
    assert ("kvtier/bin/kvtier" in names) == cli_expected()
    # nothing of the build or the sources beside the package
    assert not [n for n in names if not (n.startswith("kvtier/") or n.startswith(f"kvtier-{version}.dist-info/"))]
    assert not [n for n in names if n.endswith((".cpp", ".hpp")) or "__pycache__" in n]
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read(f"kvtier-{version}.dist-info/entry_points.txt").decode()
        metadata = z.read(f"kvtier-{version}.dist-info/METADATA").decode()
        tags = z.read(f"kvtier-{version}.dist-info/WHEEL").decode()
    assert "[vllm.general_plugins]\nkvtier = kvtier.integrations.vllm_plugin:register" in entry_points
    assert "kvtier-server = kvtier.server:main" in entry_points
    assert f"\nVersion: {version}\n" in metadata
    assert "Root-Is-Purelib: false" in tags
    return names


@pytest.mark.packaging
def test_pip_wheel_contents(installed):
    wheels = installed["tmp"] / "wheels"
    run([installed["python"], "-m", "pip", "wheel", *PIP_OFFLINE, "--no-deps", "-w", wheels, installed["source"]],
        env=build_env(installed["source"]), cwd=installed["tmp"])
    (wheel,) = wheels.glob("*.whl")
    check_wheel(wheel)


@pytest.mark.packaging
def test_sdist_builds_the_same_wheel(installed):
    """The source distribution (what `python -m build` makes first, and builds the wheel from)
    holds what the CMake build reads."""
    source, tmp = installed["source"], installed["tmp"]
    backend = ("import sys; sys.path.insert(0, 'python/build_backend'); import kvtier_build_backend as b; "
               f"print(b.build_sdist({str(tmp / 'sdist')!r}))")
    name = run([installed["python"], "-c", backend], env=build_env(source), cwd=source).strip().splitlines()[-1]
    with tarfile.open(tmp / "sdist" / name) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
        t.extractall(tmp / "from-sdist")
    for f in ("pyproject.toml", "setup.py", "CMakeLists.txt", "cmake/kvtier_python.cmake", "include/kvtier/version.hpp",
              "examples/server/main.cpp", "python/src/kvtier_module.cpp", "python/kvtier/_kvtier.pyi",
              "python/build_backend/kvtier_build_backend.py", "LICENSE", "README.md"):
        assert f in members, f"{f} not in {name}"
    assert not [m for m in members if m.startswith("build")], "no build directory in the sdist"
    unpacked = tmp / "from-sdist" / name[: -len(".tar.gz")]
    wheels = tmp / "wheels-sdist"
    run([installed["python"], "-m", "pip", "wheel", *PIP_OFFLINE, "--no-deps", "-w", wheels, unpacked],
        env=build_env(unpacked), cwd=tmp)
    (wheel,) = wheels.glob("*.whl")
    names = check_wheel(wheel)
    from_tree = list((tmp / "wheels").glob("*.whl"))
    if from_tree:  # test_pip_wheel_contents ran
        assert set(names) == set(wheel_names(from_tree[0]))
