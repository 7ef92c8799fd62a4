"""Build hygiene: the one list of C sources (csrc/sources.mk) reads the same to make and to
setup.py, and the package list that pyproject.toml's discovery finds is every package of the
source tree, and every public name of the package documents itself. (`make wheel-check` goes
further: it builds the wheel and imports all of it from a fresh venv.)"""

import os
import runpy
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def setup_py(monkeypatch):
    monkeypatch.chdir(ROOT)
    return runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="zp_setup_probe")


def test_make_and_setup_py_read_the_same_source_lists(setup_py):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    lists = setup_py["SOURCES"]
    assert {"ZP_CORE_SRC", "ZP_C_MODULE_SRC", "ZP_CUDA_MODULE_SRC", "ZP_CUDA_CU_SRC"} <= set(lists)
    rule = "zp-print: ; " + " ".join(f"@echo '{n}' $(sort $(wildcard $({n})))\n\t" for n in lists)
    out = subprocess.run([make, "-s", "--no-print-directory", "-f", "csrc/sources.mk",
                          "--eval", rule, "zp-print"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    by_make = {line.split()[0]: sorted(line.split()[1:]) for line in out.stdout.splitlines()}
    assert by_make == {name: sorted(files) for name, files in lists.items()}


def test_source_lists_refuse_what_make_would_drop(tmp_path, setup_py):
    """make's $(wildcard) drops a word that matches no file without a word; setup.py refuses it,
    so a renamed file cannot silently leave a module."""
    mk = tmp_path / "sources.mk"
    mk.write_text("A := csrc/common/*.c \\\n     csrc/no_such_file.c\n")
    with pytest.raises(ValueError, match=r"sources.mk:1: csrc/no_such_file.c matches no file"):
        setup_py["zp_sources"](str(mk))
    mk.write_text("A := csrc/common/status.c\nB := $(A) $(C)\n")
    with pytest.raises(ValueError, match=r"\$\(C\) is not defined above"):
        setup_py["zp_sources"](str(mk))
    mk.write_text("A = csrc/common/status.c\n")
    with pytest.raises(ValueError, match="not a `NAME := words` line"):
        setup_py["zp_sources"](str(mk))


def test_every_c_source_is_built_somewhere(setup_py):
    """Every .c and .cu file under csrc/ is in a module or in the core (the C tests)."""
    lists = setup_py["SOURCES"]
    built = set(lists["ZP_C_MODULE_SRC"]) | set(lists["ZP_CUDA_MODULE_SRC"]) | \
        set(lists["ZP_CUDA_CU_SRC"])
    on_disk = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "csrc")):
        on_disk |= {os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files
                    if f.endswith((".c", ".cu"))}
    assert sorted(on_disk - built) == []


def test_package_discovery_finds_every_subpackage():
    """pyproject.toml's [tool.setuptools.packages.find] against the directories of zero_py
    that hold an __init__.py."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from setuptools import find_packages

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(where=ROOT, include=find["include"], exclude=find.get("exclude", ())))
    on_disk = set()
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, "zero_py")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in files:
            on_disk.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    assert {"zero_py.kernels", "zero_py.stage3"} <= on_disk
    assert found == on_disk


def test_every_public_name_has_a_docstring_of_its_own():
    # help(zero_py.Lion) used to print torch.optim.Optimizer's "Base class for all optimizers"
    # (a class without a docstring inherits its base's), and LossScaler had none
    import inspect

    import zero_py
    lacking = []
    for name in zero_py.__all__:
        obj = getattr(zero_py, name)
        if isinstance(obj, str):  # __version__
            continue
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        if not (own or "").strip():
            lacking.append(name)
    assert lacking == []
