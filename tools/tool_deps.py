"""How the Python tools of tools/ find their third-party modules (standard library only).

Every tool parses its arguments first (so `--help` works under any python3), then calls
require(...) with the modules its work needs. When the running interpreter lacks one, the tool
runs again under Debian's /usr/bin/python3 if that one has them all (apt: python3-h5py ...);
otherwise it prints one line saying what to install and exits 2. Install for the python3 on
PATH with `python3 -m pip install -r tools/requirements.txt`. VITGRID_TOOLS_NO_REEXEC=1 turns
the re-run off."""
import importlib
import os
import subprocess
import sys

SYSTEM_PYTHON = "/usr/bin/python3"
# module -> Debian package that provides it for /usr/bin/python3 (None: pip only)
DEBIAN = {"h5py": "python3-h5py", "numpy": "python3-numpy", "matplotlib": "python3-matplotlib",
          "torch": "python3-torch", "torchvision": "python3-torchvision", "PIL": "python3-pil",
          "timm": None, "skimage": "python3-skimage"}
PIP = {"PIL": "Pillow", "skimage": "scikit-image"}


def missing(modules):
    """The modules of `modules` that do not import in this interpreter (broken ones count)."""
    out = []
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception:  # ImportError, or a module that fails while importing
            out.append(m)
    return out


def _system_python_has(modules):
    if os.environ.get("VITGRID_TOOLS_NO_REEXEC") or not os.access(SYSTEM_PYTHON, os.X_OK):
        return False
    if os.path.realpath(sys.executable) == os.path.realpath(SYSTEM_PYTHON):
        return False
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    try:
        r = subprocess.run([SYSTEM_PYTHON, "-c", code, *modules], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def require(tool, *modules):
    """Returns when every module imports here; else re-runs the tool (same arguments) under
    /usr/bin/python3 when that one has them all, else prints one line and exits 2."""
    miss = missing(modules)
    if not miss:
        return
    if _system_python_has(modules):
        sys.stdout.flush()
        sys.stderr.flush()
        script = os.path.abspath(sys.argv[0])
        os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON, script, *sys.argv[1:]])
    debs = sorted({DEBIAN[m] for m in miss if DEBIAN.get(m)})
    hint = f"python3 -m pip install -r {os.path.join(os.path.dirname(os.path.abspath(__file__)), 'requirements.txt')}"
    if debs:
        hint += f" (or, for {SYSTEM_PYTHON}: apt-get install {' '.join(debs)})"
    print(f"{tool}: needs {', '.join(PIP.get(m, m) for m in miss)}, missing from {sys.executable}: "
          f"{hint}", file=sys.stderr)
    sys.exit(2)
