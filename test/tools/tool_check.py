"""The harness the tool tests share: a tool of tools/ loaded as a module, and checks that
print ok / FAIL lines and set the exit status."""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("VITGRID_SOURCE_DIR", os.path.join(HERE, "..", ".."))
_failed = 0


def load_tool(name):
    """tools/<name>.py as a module (its main() not run)."""
    path = os.path.join(ROOT, "tools", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check(ok, what):
    global _failed
    print(("ok   " if ok else "FAIL ") + what)
    _failed += 0 if ok else 1


def finish():
    """Exits 1 if any check failed, else 0."""
    print(f"FAILED ({_failed})" if _failed else "all passed")
    sys.exit(1 if _failed else 0)
