"""Checks an installed zero_py wheel (`make wheel-check` runs this with a fresh venv's python):
every module of the source tree is in the wheel, and every module of the installed package,
the C extensions included, imports from the venv rather than from the source tree.

An editable install (`make build`) imports from the source tree, so it hides a wheel that
lacks a subpackage or an extension; worse, its import hook answers for a subpackage the wheel
lacks, so an import alone would pass: each module's file is checked to be the venv's.

Usage: python -I check_wheel.py WHEEL SOURCE_PACKAGE_DIR   (not from the repository root)
"""

import importlib
import os
import pkgutil
import sys
import time
import zipfile

PACKAGE = "zero_py"


def source_modules(src_dir):
    """Module names of the source tree's .py files, under directories that are packages."""
    names = set()
    root = os.path.dirname(os.path.abspath(src_dir))
    for dirpath, dirnames, filenames in os.walk(src_dir):
        if "__init__.py" not in filenames:
            dirnames[:] = []  # not a package: neither it nor anything below ships
            continue
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        pkg = os.path.relpath(dirpath, root).replace(os.sep, ".")
        names.add(pkg)
        names.update(f"{pkg}.{f[:-3]}" for f in filenames
                     if f.endswith(".py") and f != "__init__.py")
    return names


def wheel_top_level(wheel):
    with zipfile.ZipFile(wheel) as z:
        return {name.split("/", 1)[0] for name in z.namelist()}


def main():
    wheel, src_dir = sys.argv[1], os.path.realpath(sys.argv[2])
    start = time.monotonic()
    failures = []

    tops = wheel_top_level(wheel)
    stray = sorted(t for t in tops if t != PACKAGE and not t.endswith(".dist-info"))
    if stray:
        failures.append(f"the wheel holds more than {PACKAGE}: {stray}")

    pkg = importlib.import_module(PACKAGE)
    prefix = os.path.realpath(sys.prefix)
    if sys.prefix == sys.base_prefix:
        failures.append(f"not run in a venv (sys.prefix {sys.prefix})")

    def onerror(name):
        failures.append(f"{name}: import failed: {sys.exc_info()[1]!r}")

    installed = {PACKAGE}
    for info in pkgutil.walk_packages(pkg.__path__, PACKAGE + ".", onerror=onerror):
        installed.add(info.name)
    for name in sorted(installed):
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - report every module that fails
            failures.append(f"{name}: import failed: {exc!r}")
            continue
        where = os.path.realpath(getattr(mod, "__file__", None) or "")
        if not where.startswith(prefix + os.sep) or where.startswith(src_dir + os.sep):
            failures.append(f"{name}: imported from {where or '(no file)'}, not from the venv "
                            f"{prefix}: the wheel lacks it")

    # zero_py's own imports included: an editable install's import hook would answer for a
    # subpackage the wheel lacks
    for name, mod in sorted(sys.modules.items()):
        if name.split(".", 1)[0] == PACKAGE and name not in installed:
            where = os.path.realpath(getattr(mod, "__file__", None) or "")
            failures.append(f"{name}: imported from {where or '(no file)'}: the wheel lacks it")
    missing = sorted(source_modules(src_dir) - installed)
    if missing:
        failures.append(f"in the source tree but not in the wheel: {missing}")
    if f"{PACKAGE}._C" not in installed:
        failures.append(f"{PACKAGE}._C is not in the wheel")
    else:
        importlib.import_module(f"{PACKAGE}._C").cpu_isa()  # the module runs, not only loads

    if failures:
        print("wheel-check FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    exts = sorted(n for n in installed if n.rsplit(".", 1)[-1] in ("_C", "_cuda"))
    print(f"wheel-check: {len(installed)} modules of {os.path.basename(wheel)} import from the "
          f"venv (extensions: {', '.join(exts)}) in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
