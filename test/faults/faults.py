#!/usr/bin/env python3
"""The fault corpus: vitgrid on bad input, every run classified (run by ctest, one test per name).

    faults.py corpus      fixed bad decks, paths and files: every case of the fault probe's list
                          and the usual suspects (unknown keys, bad types, extreme numbers,
                          impossible layouts, missing files, garbage, long lines, NUL bytes)
    faults.py deck_fuzz   seeded mutations of test/app/tiny.ini and inputs/*.ini
    faults.py data_fuzz   seeded byte mutations of small HDF5 image files, CIFAR-10 binaries and
                          JPEG sources (an ImageFolder tree, TFRecord shards, a jpeg_h5 pair)
    faults.py ckpt_fuzz   seeded byte mutations of a real checkpoint, loaded by eval (and, one
                          case in four, resumed from by train)

Every run is vitgrid on 2 CPU ranks under mpirun, in a process group of its own, classified:
  ok        exit 0
  refused   exit 2, exactly one "vitgrid: error:" line, no crash trace
  CRASH     a signal (134, 139, ...), "terminate called", an abort or a backtrace in the output
  UNCLEAN   any other failure: an exit other than 2, or not exactly one message (MPI_Abort after
            a rank-local error, two ranks printing)
  HANG      no exit within VG_FAULTS_RUN_TIMEOUT seconds (the process group is killed)
  LOST      checkpoint cases: a complete checkpoint missing or changed afterwards (or the
            loaded file changed)
  WRONG     fixed cases only: the expected outcome did not happen (accepted bad input, or a
            refusal that does not name the key or file)
The test fails on any CRASH, UNCLEAN, HANG, LOST or WRONG and prints a summary table.

Environment: VG_FAULTS_SEED (default 1), VG_FAULTS_BUDGET_S (seconds of mutations per fuzzer,
default 30), VG_FAULTS_RUN_TIMEOUT (seconds per run, default 60), VG_FAULTS_CASE (run only
mutation #i of a fuzzer), VG_FAULTS_KEEP=1 (keep the temp dir). Mutation i is a function of
(seed, fuzzer, i) alone: the printed seed and case number reproduce a failure
(VG_FAULTS_SEED=s VG_FAULTS_CASE=i faults.py deck_fuzz). Failing inputs are saved under
TMP/failures/ with their command line, and the temp dir is kept when anything fails.
VG_FAULTS_JOBS (launches at a time, default 4). Each run's address space is limited (2 GiB a
process): an input that makes vitgrid allocate beyond it must be refused, not take the shared
test machine down."""
import collections
import concurrent.futures
import hashlib
import itertools
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("VITGRID_SOURCE_DIR", os.path.normpath(os.path.join(HERE, "..", "..")))
VITGRID = os.path.abspath(os.environ.get("VITGRID_BIN", "build/bin/vitgrid"))
TINY = os.path.join(SRC, "test", "app", "tiny.ini")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
SEED = int(os.environ.get("VG_FAULTS_SEED", "1"))
BUDGET_S = float(os.environ.get("VG_FAULTS_BUDGET_S", "30"))
RUN_TIMEOUT = float(os.environ.get("VG_FAULTS_RUN_TIMEOUT", "60"))
ONLY_CASE = os.environ.get("VG_FAULTS_CASE")
JOBS = int(os.environ.get("VG_FAULTS_JOBS", "4"))  # launches at a time: mostly MPI start-up waits
MEMORY_LIMIT = 2 << 30

CLASSES = ["ok", "refused", "CRASH", "UNCLEAN", "HANG", "LOST", "WRONG"]
FAILING = {"CRASH", "UNCLEAN", "HANG", "LOST", "WRONG"}
CRASH_RE = re.compile(r"terminate called|Signal: |Segmentation fault|Aborted|exited on signal|"
                      r"\*\*\* Process received signal|\[\S+:\d+\] \[ ?\d+\] |what\(\):|"
                      r"core dumped|Assertion .* failed|double free|corrupted size")


# ---------------------------------------------------------------------------------------------
# Running and classifying


def limit_memory():
    # in the child before exec: mpirun and the ranks it forks inherit it
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, resource.RLIM_INFINITY))


class Run:
    """One vitgrid launch: command, exit code (None: killed), output, whether it was cut on
    purpose (stop_on matched: an accepted deck training for long) and how long it took."""

    def __init__(self, cmd, rc, out, cut, seconds, timeout):
        self.cmd, self.rc, self.out, self.cut, self.seconds = cmd, rc, out, cut, seconds
        self.timeout = timeout


def session_pids(sid):
    """The processes of session `sid` (the one mpirun was started in: its ranks too, although
    Open MPI puts each rank in a process group of its own)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:  # field 6 of stat: the session id
                    pids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def stop(p):
    """Ends a launch and everything it started: SIGTERM to mpirun (it takes its ranks down),
    then SIGKILL to whatever of its session is left."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    for pid in session_pids(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if p.poll() is None:
        p.wait()


def launch(args, cwd, np_=2, timeout=None, stop_on=None):
    """mpirun -np 2 vitgrid ARGS in a session of its own, ended (with its ranks) on timeout or
    once `stop_on` (a regex) shows up in the output."""
    timeout = RUN_TIMEOUT if timeout is None else timeout
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", VITGRID] + args
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=limit_memory)
    chunks, matched = [], threading.Event()

    def reader():
        for line in iter(p.stdout.readline, b""):
            chunks.append(line)
            if stop_on and re.search(stop_on, line.decode("utf-8", "replace")):
                matched.set()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    cut = exited = False
    while time.monotonic() < t0 + timeout:
        try:
            p.wait(timeout=0.05)
            exited = True
            break
        except subprocess.TimeoutExpired:
            if matched.is_set():
                cut = True
                break
    rc = p.returncode if exited else None
    stop(p)  # also when mpirun exited: no rank may outlive it
    th.join(timeout=5)
    out = b"".join(chunks).decode("utf-8", "replace")
    return Run(cmd, rc, out, cut, time.monotonic() - t0, timeout)


def classify(run):
    """(class, reason) of a finished run."""
    if run.cut:
        return "ok", "accepted, training under way (cut)"
    if run.rc is None:
        return "HANG", f"no exit within {run.timeout:.0f} s"
    crash = CRASH_RE.search(run.out)
    if run.rc < 0 or run.rc >= 128 or crash:
        return "CRASH", f"exit {run.rc}" + (f", '{crash.group(0)}'" if crash else "")
    if run.rc == 0:
        return "ok", "exit 0"
    n = run.out.count("vitgrid: error:")
    if run.rc == 2 and n == 1:
        return "refused", error_line(run.out)[:300]
    return "UNCLEAN", f"exit {run.rc}, {n} 'vitgrid: error:' line(s)"


def error_line(out):
    for ln in out.splitlines():
        if "vitgrid: error:" in ln:
            return ln[ln.index("vitgrid: error:"):]
    return ""


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def snapshot(directory):
    """{relative path: sha256} of every file under directory."""
    out = {}
    for root, _, files in os.walk(directory):
        for n in files:
            p = os.path.join(root, n)
            out[os.path.relpath(p, directory)] = sha(p)
    return out


class Report:
    """Counts per (group, class), the failures with everything needed to reproduce them."""

    def __init__(self, name, tmp):
        self.name, self.tmp = name, tmp
        self.counts = {}
        self.failures = []
        self.t0 = time.monotonic()
        self.runs = 0

    def add(self, group, cls, reason, run, what, keep=()):
        self.runs += 1
        self.counts.setdefault(group, {c: 0 for c in CLASSES})[cls] += 1
        tag = f"[{self.runs:4d}] {cls:8s} {group:18s} {what[:110]}"
        print(tag + (f"  -- {reason[:200]}" if cls != "ok" else ""), flush=True)
        if cls in FAILING:
            saved = os.path.join(self.tmp, "failures", f"{self.name}_{self.runs:04d}")
            os.makedirs(saved, exist_ok=True)
            for p in keep:
                if os.path.isfile(p):
                    shutil.copy(p, saved)
            with open(os.path.join(saved, "run.txt"), "w") as f:
                f.write(f"seed {SEED}\n{what}\n{' '.join(run.cmd) if run else ''}\n\n"
                        f"{run.out if run else ''}")
            self.failures.append((cls, group, what, reason, run, saved, list(keep)))

    def summary(self):
        width = max([len(g) for g in self.counts] + [5])
        head = f"{'group':{width}s} " + " ".join(f"{c:>7s}" for c in CLASSES)
        lines = [f"faults {self.name}: seed {SEED}, {self.runs} runs in "
                 f"{time.monotonic() - self.t0:.0f} s", head, "-" * len(head)]
        total = {c: 0 for c in CLASSES}
        for g, cnt in self.counts.items():
            lines.append(f"{g:{width}s} " + " ".join(f"{cnt[c]:7d}" for c in CLASSES))
            for c in CLASSES:
                total[c] += cnt[c]
        lines.append("-" * len(head))
        lines.append(f"{'total':{width}s} " + " ".join(f"{total[c]:7d}" for c in CLASSES))
        print("\n" + "\n".join(lines))
        for cls, group, what, reason, run, saved, keep in self.failures:
            print(f"\n{cls} ({group}): {what}\n  {reason}\n  saved in {saved}")
            for p in keep:  # a mutated deck is short: show it
                if p.endswith(".ini") and os.path.isfile(p) and os.path.getsize(p) < 8192:
                    print(f"  input {os.path.basename(p)}:\n    " +
                          "\n    ".join(read(p, "rb").decode("utf-8", "backslashreplace").splitlines()))
            if run:
                print("  command: " + " ".join(run.cmd))
                print("  output (tail):\n    " + "\n    ".join(run.out[-1500:].splitlines()))
        return not self.failures


# ---------------------------------------------------------------------------------------------
# Decks: text helpers


def read(path, mode="r"):
    with open(path, mode) as f:
        return f.read()


def write(path, data):
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return path


def set_key(text, section, key, value):
    """Deck text with section.key = value (replaced where it is, else added to the section,
    else in a new section at the end)."""
    lines, cur, done, sec_end = text.split("\n"), None, False, None
    for i, ln in enumerate(lines):
        s = ln.split("#")[0].strip()
        if s.startswith("[") and s.endswith("]"):
            if cur == section:
                sec_end = i
            cur = s[1:-1].strip()
        elif cur == section and "=" in s and s.split("=")[0].strip() == key:
            lines[i] = f"{key} = {value}"
            done = True
    if not done:
        if cur == section and sec_end is None:
            lines.append(f"{key} = {value}")
        elif sec_end is not None:
            lines.insert(sec_end, f"{key} = {value}")
        else:
            lines += [f"[{section}]", f"{key} = {value}"]
    return "\n".join(lines)


def ini_values(text):
    """{section.key: value} of INI text, leniently (garbage lines skipped)."""
    out, cur = {}, ""
    for ln in text.split("\n"):
        s = ln.split("#")[0].strip()
        if s.startswith("[") and s.endswith("]"):
            cur = s[1:-1].strip()
        elif "=" in s:
            k, v = s.split("=", 1)
            out[f"{cur}.{k.strip()}"] = v.strip()
    return out


# ---------------------------------------------------------------------------------------------
# The fixed corpus


def corpus(tmp, rep):
    """Fixed cases: (group, description, args, expectation). Expectation: ("refused", [texts the
    message must contain]), ("ok", [texts the output must contain]) or ("any", [])."""
    tiny = read(TINY)
    out = os.path.join(tmp, "out")
    steps = ["--run.steps=2", "--checkpoint.every_steps=0"]
    cases = []

    def deck(group, what, text, expect, extra=(), cmd="train", use_steps=True, key=None):
        # (`key`: the one the case sets in the deck; no override may hide it)
        name = f"{len(cases):03d}_" + re.sub(r"[^A-Za-z0-9]+", "_", what)[:60] + ".ini"
        path = write(os.path.join(tmp, "decks", name), text)
        over = [o for o in steps if not (key and o.startswith(f"--{key}="))] if use_steps else []
        args = [cmd, path, f"--run.out_dir={out}_{len(cases)}"] + over + list(extra)
        cases.append((group, what, args, expect, [path]))

    def cli(group, what, extra, expect, cmd="train", base=TINY, use_steps=True, out_dir=True):
        args = [cmd, base] + ([f"--run.out_dir={out}_{len(cases)}"] if out_dir else []) + \
            (steps if use_steps else []) + list(extra)
        cases.append((group, what, args, expect, []))

    def refuse(*texts):
        return ("refused", list(texts))

    os.makedirs(os.path.join(tmp, "decks"))
    plain = write(os.path.join(tmp, "plain.txt"), "x")
    fifo = os.path.join(tmp, "a.fifo")
    os.mkfifo(fifo)

    # -- the fault probe's list: run.out_dir
    for d, why in [("/proc/vitgrid_x", "cannot be created"), ("/proc", "not writable"),
                   ("/sys/kernel", "not writable"), (plain + "/x", "Not a directory"),
                   (plain, "not a directory"), (os.path.join(tmp, "b" * 300), "File name too long")]:
        cli("out_dir", f"run.out_dir={d[:50]}", [f"--run.out_dir={d}"], refuse("run.out_dir", why),
            out_dir=False)
    if os.geteuid() != 0:  # permission bits stop only ordinary users
        ro = os.path.join(tmp, "ro")
        os.mkdir(ro, 0o555)
        cli("out_dir", "run.out_dir read-only (0555)", [f"--run.out_dir={ro}/run"],
            refuse("run.out_dir", "Permission denied"), out_dir=False)
    taken = os.path.join(tmp, "ckfile")
    os.makedirs(taken)
    write(os.path.join(taken, "checkpoints"), "x")
    cli("out_dir", "run.out_dir/checkpoints is a file", [f"--run.out_dir={taken}", "--checkpoint.resume=auto"],
        refuse("run.out_dir", "checkpoints"), out_dir=False)
    cli("out_dir", "predict into /proc/x", [f"--checkpoint.load={plain}", "--run.out_dir=/proc/x"],
        refuse("run.out_dir", "/proc/x"), cmd="predict", use_steps=False, out_dir=False)

    # -- sizes
    for extra, key in [(["--data.synthetic_train=8589934592"], "data.synthetic_train"),
                       (["--data.synthetic_eval=9223372036854775807"], "data.synthetic_eval"),
                       (["--model.image_size=1000000"], "model.image_size"),
                       (["--model.image_size=2147483647"], "model.image_size"),
                       (["--model.image_size=2147483648"], "model.image_size"),
                       (["--model.image_size=8192", "--model.patch_size=1"], "model.image_size"),
                       (["--model.hidden=65536", "--model.depth=1024", "--model.mlp_ratio=64",
                         "--model.heads=64"], "model.hidden"),
                       (["--model.mlp_ratio=1e308"], "model.mlp_ratio"),
                       (["--model.num_classes=2147483647"], "model.num_classes"),
                       (["--data.global_batch=9223372036854775807"], "data.global_batch"),
                       (["--data.global_batch=4294967296"], "data.global_batch"),
                       (["--data.workers=2147483647"], "data.workers"),
                       (["--data.prefetch=2147483647"], "data.prefetch"),
                       (["--data.crop_padding=2147483647"], "data.crop_padding"),
                       (["--parallel.pipeline=65536", "--parallel.tensor=65536"], "parallel.tensor"),
                       (["--parallel.schedule=interleaved", "--parallel.chunks=2147483647"], "parallel.chunks"),
                       (["--optim.warmup_epochs=1e308"], "optim.warmup_epochs")]:
        cli("sizes", " ".join(extra), extra, refuse(key))
    cli("sizes", "run.epochs=1e308", ["--run.epochs=1e308", "--checkpoint.every_steps=0"],
        refuse("run.epochs"), use_steps=False)

    # -- the deck file
    cli("deck file", "FIFO as the deck", [], refuse(fifo, "not a regular file"), base=fifo)
    cli("deck file", "directory as the deck", [], refuse(tmp, "is a directory"), base=tmp)
    cli("deck file", "/dev/null as the deck", [], refuse("/dev/null", "not a regular file"), base="/dev/null")
    cli("deck file", "missing deck", [], refuse("nowhere.ini", "cannot open"), base=os.path.join(tmp, "nowhere.ini"))
    loop = os.path.join(tmp, "loop.ini")
    os.symlink(loop, loop)
    cli("deck file", "symlink loop as the deck", [], refuse("loop.ini", "cannot open"), base=loop)
    deck("deck file", "UTF-8 BOM", "\ufeff" + tiny, ("ok", []))
    deck("deck file", "CRLF line ends", tiny.replace("\n", "\r\n"), ("ok", []))
    deck("deck file", "CR-only line ends", tiny.replace("\n", "\r"), refuse("control character 0x0d"))
    deck("deck file", "empty deck", "", refuse("run.steps"), use_steps=False)
    deck("deck file", "comments only", "# nothing\n; nor this\n", refuse(";"), use_steps=False)
    deck("deck file", "sections without keys", "[run]\n[model]\n[data]\n", refuse("run.steps"), use_steps=False)
    deck("deck file", "empty section name", "[]\nsteps = 2\n", refuse("unknown section"))
    deck("deck file", "unclosed section", "[run\nsteps = 2\n", refuse("malformed section header"))
    deck("deck file", "key outside sections", "steps = 2\n" + tiny, refuse("outside any [section]"))
    deck("deck file", "line without =", tiny + "\n[run]\nsteps\n", refuse("expected 'key = value'"))
    deck("deck file", "= without key", "[run]\n= 2\n", refuse("missing key"))
    deck("deck file", "duplicate key", tiny + "\n[run]\nseed = 8\n", refuse("run.seed", "given twice"))
    deck("deck file", "duplicate section, new key", tiny + "\n[run]\nlog_every = 1\n", refuse("run.log_every", "given twice"))
    deck("deck file", "NUL in a value", tiny.replace("seed = 7", "seed = 7\0"), refuse("control character 0x00"))
    deck("deck file", "NUL in a key", tiny.replace("seed = 7", "se\0ed = 7"), refuse("control character 0x00"))
    deck("deck file", "NUL bytes only", "\0" * 64, refuse("control character 0x00"))
    rnd = random.Random(SEED)
    deck("deck file", "binary garbage", bytes(rnd.randrange(256) for _ in range(4096)), refuse(".ini:"))
    deck("deck file", "gzip header", b"\x1f\x8b\x08\x00" + bytes(rnd.randrange(256) for _ in range(200)),
         refuse(".ini:1"))
    deck("deck file", "1 MB value", set_key(tiny, "model", "gelu", "o" * (1 << 20)),
         refuse("model.gelu", "characters)"))
    deck("deck file", "1 MB key", tiny + "\n[run]\n" + "k" * (1 << 20) + " = 1\n", refuse("unknown key", "characters)"))
    deck("deck file", "1 MB comment line", "#" + "c" * (1 << 20) + "\n" + tiny, ("ok", []))
    deck("deck file", "17 MiB deck", tiny + "\n#" + "c" * (17 << 20) + "\n", refuse("small text file"))
    deck("deck file", "unicode key", "[run]\nst\u00e9ps = 2\n", refuse("unknown key"))

    # -- keys and types
    deck("keys", "unknown key", set_key(tiny, "run", "stepz", "2"), refuse("run.stepz"))
    deck("keys", "unknown section", tiny + "\n[runn]\nsteps = 2\n", refuse("unknown section [runn]"))
    cli("keys", "unknown key on the command line", ["--model.hiden=32"], refuse("model.hiden"))
    cli("keys", "argument without dashes", ["run.steps=2"], refuse("run.steps=2"), use_steps=False)
    cli("keys", "dangling --key", ["--checkpoint.every_steps=0", "--run.steps"], refuse("run.steps"), use_steps=False)
    cli("keys", "'#' in a command-line value", ["--run.out_dir=a#b"], refuse("run.out_dir"), out_dir=False)
    cli("keys", "empty command-line value", ["--model.hidden="], refuse("model.hidden"))
    for sec, key, val in [("model", "hidden", "abc"), ("run", "steps", "2.5"), ("data", "hflip", "maybe"),
                          ("optim", "lr", "fast"), ("data", "mean", "a,b,c"), ("data", "std", "1,2"),
                          ("run", "seed", "-1"), ("run", "seed", "18446744073709551616"),
                          ("run", "steps", "9223372036854775808"), ("model", "hidden", "0x10"),
                          ("model", "hidden", "1e3"), ("model", "hidden", ""), ("optim", "lr", "nan"),
                          ("optim", "lr", "inf"), ("optim", "lr", "1e309"), ("model", "gelu", "relu"),
                          ("precision", "mode", "fp8"), ("optim", "name", "ADAMW"),
                          ("model", "preset", "vit-gigantic"), ("data", "dataset", "imagenet")]:
        deck("types", f"{sec}.{key} = {val!r}", set_key(tiny, sec, key, val), refuse(f"{sec}.{key}"),
             key=f"{sec}.{key}")

    # -- negative, zero and huge numbers
    for sec, key, val in [("model", "hidden", "0"), ("model", "hidden", "-1"), ("model", "depth", "0"),
                          ("model", "heads", "0"), ("model", "heads", "5"), ("model", "patch_size", "0"),
                          ("model", "patch_size", "3"), ("model", "num_classes", "0"),
                          ("model", "channels", "1"), ("model", "dropout", "1"), ("model", "drop_path", "1.5"),
                          ("model", "mlp_ratio", "0.001"), ("model", "checkpoint_blocks", "-2"),
                          ("data", "global_batch", "0"), ("data", "global_batch", "-16"),
                          ("data", "global_batch", "15"), ("data", "grad_accum", "0"),
                          ("data", "synthetic_train", "0"), ("data", "synthetic_eval", "-1"),
                          ("data", "crop_padding", "-1"), ("data", "prefetch", "-1"), ("data", "workers", "-1"),
                          ("data", "mixup_alpha", "-0.1"), ("data", "label_smoothing", "1"),
                          ("data", "std", "0,1,1"), ("run", "log_every", "0"), ("run", "log_every", "2147483648"),
                          ("run", "eval_every", "-1"), ("run", "eval_samples", "-1"),
                          ("optim", "lr", "0"), ("optim", "lr", "-1"), ("optim", "min_lr", "1"),
                          ("optim", "beta1", "1"), ("optim", "beta2", "-0.5"), ("optim", "eps", "0"),
                          ("optim", "warmup_steps", "-1"), ("optim", "clip_grad_norm", "-1"),
                          ("precision", "initial_scale", "0"), ("precision", "growth_factor", "1"),
                          ("precision", "backoff_factor", "1"), ("precision", "growth_interval", "0"),
                          ("checkpoint", "every_steps", "-1"), ("checkpoint", "keep", "-1"),
                          ("device", "comm_timeout", "0"), ("device", "gemm_tune", "17"),
                          ("device", "data_comm_ctas", "65"), ("device", "gemm_sm_margin", "-1")]:
        deck("numbers", f"{sec}.{key} = {val}", set_key(tiny, sec, key, val), refuse(f"{sec}.{key}"),
             key=f"{sec}.{key}")
    deck("numbers", "run.steps = -1", set_key(tiny, "run", "steps", "-1"), refuse("run.steps"), use_steps=False)
    deck("numbers", "run.steps = 0", set_key(tiny, "run", "steps", "0"), refuse("run.steps"), use_steps=False)
    # accepted extremes: still a clean run
    deck("numbers", "optim.lr = 1e308 (runs)", set_key(tiny, "optim", "lr", "1e308"), ("any", []))
    deck("numbers", "run.seed = 2^64-1 (runs)", set_key(tiny, "run", "seed", "18446744073709551615"), ("ok", []))
    deck("numbers", "precision.initial_scale = 1e308 (runs)",
         set_key(set_key(tiny, "precision", "initial_scale", "1e308"), "precision", "mode", "fp16"), ("any", []))
    deck("numbers", "data.mixup_alpha = 1e308 (runs)", set_key(tiny, "data", "mixup_alpha", "1e308"), ("any", []))

    # -- parallel layouts that cannot be (2 ranks)
    for extra, key in [(["--parallel.tensor=3"], "parallel.tensor"), (["--parallel.pipeline=4"], "parallel.pipeline"),
                       (["--parallel.pipeline=2", "--parallel.tensor=2"], "parallel.pipeline"),
                       (["--parallel.tensor=2", "--parallel.tensor_mode=2d"], "parallel.tensor"),
                       (["--parallel.tensor=2", "--parallel.tensor_mode=3d"], "parallel.tensor"),
                       (["--parallel.tensor=2", "--parallel.tensor_mode=2.5d", "--parallel.tensor_depth=0"],
                        "parallel.tensor_depth"),
                       (["--parallel.pipeline=2", "--model.depth=3"], "model.depth"),
                       (["--parallel.pipeline=2", "--parallel.micro_batches=3"], "parallel.micro_batches"),
                       (["--parallel.schedule=interleaved", "--parallel.chunks=1"], "parallel.chunks"),
                       (["--parallel.chunks=2"], "parallel.chunks"),
                       (["--parallel.pipeline=2", "--parallel.partition=list:1"], "parallel.partition"),
                       (["--parallel.pipeline=2", "--parallel.partition=list:a,b"], "parallel.partition"),
                       (["--parallel.data=3"], "parallel.data"), (["--parallel.sequence_parallel=true"],
                                                                  "parallel.sequence_parallel"),
                       (["--parallel.zero=2"], "parallel.zero"), (["--parallel.grad_reduce=act"], "parallel.grad_reduce"),
                       (["--device.data_comm=copy_engine"], "device.data_comm"),
                       (["--device.backend=cuda"], "device.backend"),
                       (["--parallel.tensor=2", "--model.heads=3", "--model.hidden=18"], "model.heads")]:
        cli("layout", " ".join(extra), extra, refuse(key))

    # -- files: missing, not regular, malformed
    cifar = os.path.join(tmp, "cifar_fifo")
    os.makedirs(cifar)
    for i in range(1, 6):
        write(os.path.join(cifar, f"data_batch_{i}.bin"), bytes(3073))
    os.mkfifo(os.path.join(cifar, "test_batch.bin"))
    cifar_dir = os.path.join(tmp, "cifar_dirfile")
    os.makedirs(os.path.join(cifar_dir, "data_batch_1.bin"))
    c32 = ["--model.image_size=32", "--model.num_classes=10"]
    cli("files", "cifar10 directory missing", ["--data.dataset=cifar10", f"--data.path={tmp}/nowhere"] + c32,
        refuse("data.path", "nowhere"))
    cli("files", "cifar10 test_batch.bin is a FIFO", ["--data.dataset=cifar10", f"--data.path={cifar}"] + c32,
        refuse("data.path", "test_batch.bin", "not a regular file"))
    cli("files", "cifar10 data_batch_1.bin is a directory", ["--data.dataset=cifar10", f"--data.path={cifar_dir}"] + c32,
        refuse("data.path", "data_batch_1.bin"))
    cli("files", "cifar10 files of the wrong size", ["--data.dataset=cifar10", f"--data.path={make_cifar(tmp, 'cwrong', extra=5)}"] + c32,
        refuse("data_batch_1.bin", "3073"))
    cli("files", "cifar10 empty files", ["--data.dataset=cifar10", f"--data.path={make_cifar(tmp, 'cempty', records=0)}"] + c32,
        refuse("data_batch_1.bin"))
    cli("files", "cifar10 label 10", ["--data.dataset=cifar10", f"--data.path={make_cifar(tmp, 'clabel', label=10)}"] + c32,
        refuse("label 10"))
    for path, why in [("/dev/zero", "not a regular file"), (fifo, "not a regular file"),
                      (os.path.join(tmp, "none.h5"), "does not exist"), (tmp, "is a directory"),
                      (plain, "not an HDF5 file"), (write(os.path.join(tmp, "empty.h5"), b""), "not an HDF5 file")]:
        cli("files", f"hdf5 data.path={path[-40:]}", ["--data.dataset=hdf5", f"--data.path={path}"],
            refuse("data.path" if why != "not an HDF5 file" else path, why))
    cli("files", "hdf5 data.eval_path=/dev/zero",
        ["--data.dataset=hdf5", f"--data.path={make_h5(tmp, 'good.h5')}", "--data.eval_path=/dev/zero"],
        refuse("data.eval_path", "not a regular file"))
    cli("files", "hdf5 without num_classes (warns, runs)",
        ["--data.dataset=hdf5", f"--data.path={make_h5(tmp, 'noattr.h5', attr=False)}",
         f"--data.eval_path={tmp}/noattr.h5"], ("ok", ["largest label + 1 = 4", "f.attrs['num_classes']"]))
    cli("files", "hdf5 images 16x16 for an 8x8 model",
        ["--data.dataset=hdf5", f"--data.path={make_h5(tmp, 's16.h5', size=16)}", f"--data.eval_path={tmp}/s16.h5"],
        refuse("model.image_size"))
    cli("files", "hdf5 truncated", ["--data.dataset=hdf5", f"--data.path={truncated(make_h5(tmp, 'cut.h5'), 0.6)}",
                                     f"--data.eval_path={tmp}/cut.h5"], refuse("cut.h5"))
    cli("files", "hdf5 label 9 with num_classes 4", ["--data.dataset=hdf5",
                                                    f"--data.path={make_h5(tmp, 'lab.h5', bad_label=9)}",
                                                    f"--data.eval_path={tmp}/lab.h5"], refuse("lab.h5", "9"))
    cli("files", "eval without checkpoint.load", [], refuse("checkpoint.load"), cmd="eval", use_steps=False)
    for path, why in [(os.path.join(tmp, "none.h5"), "does not exist"), (fifo, "not a regular file"),
                      (tmp, "is a directory"), ("/dev/zero", "not a regular file"), (plain, "plain.txt")]:
        cli("files", f"eval checkpoint.load={path[-40:]}", [f"--checkpoint.load={path}"],
            refuse("checkpoint.load" if why != "plain.txt" else "plain.txt", why), cmd="eval", use_steps=False)

    def one(i):
        group, what, args, expect, keep = cases[i]
        run = launch(args, cwd=tmp)
        cls, reason = classify(run)
        want, texts = expect
        if cls not in FAILING:
            out = run.out
            if want == "refused" and (cls != "refused" or not all(t in error_line(out) for t in texts)):
                cls, reason = "WRONG", f"expected a refusal naming {texts}; got {cls}: {reason}"
            elif want == "ok" and (cls != "ok" or not all(t in out for t in texts)):
                cls, reason = "WRONG", f"expected a clean run showing {texts}; got {cls}: {reason}"
        return group, cls, reason, run, what, keep

    execute(rep, one, count=len(cases))


def make_cifar(tmp, name, records=2, extra=0, label=None):
    """A CIFAR-10 binary directory: 5 train files and the test file of `records` records each,
    `extra` stray bytes appended, label byte `label` in the first record."""
    d = os.path.join(tmp, name)
    os.makedirs(d)
    rnd = random.Random(7)
    for n in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        recs = bytearray()
        for r in range(records):
            recs += bytes([r % 10]) + bytes(rnd.randrange(256) for _ in range(3072))
        if label is not None and records:
            recs[0] = label
        write(os.path.join(d, n), bytes(recs) + bytes(extra))
    return d


def make_h5(tmp, name, n=32, size=8, attr=True, bad_label=None, chunked=False):
    import h5py
    import numpy as np
    path = os.path.join(tmp, name)
    rng = np.random.default_rng(3)
    labels = np.arange(n) % 4
    if bad_label is not None:
        labels[5] = bad_label
    with h5py.File(path, "w") as f:
        if chunked:
            f.create_dataset("images", data=rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8),
                             chunks=(4, size, size, 3), compression="gzip")
        else:
            f["images"] = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
        f["labels"] = labels
        if attr:
            f.attrs["num_classes"] = 4
    return path


def truncated(path, frac):
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * frac))
    return path


# ---------------------------------------------------------------------------------------------
# Fuzzing helpers


def case_rng(fuzzer, i):
    """The random stream of mutation i of a fuzzer: a function of (seed, fuzzer, i) alone."""
    return random.Random(f"{SEED}/{fuzzer}/{i}")


def execute(rep, case, count=None):
    """Runs case(i) for i = 0, 1, ... (each returns (group, class, reason, run, what, inputs)),
    JOBS at a time, reported in order: i < count, or for the fuzzers (count None) new cases
    start until VG_FAULTS_BUDGET_S seconds have passed (only VG_FAULTS_CASE when set)."""
    t0 = time.monotonic()
    if count is not None:
        numbers = iter(range(count))
    elif ONLY_CASE is not None:
        numbers = iter([int(ONLY_CASE)])
    else:
        numbers = itertools.takewhile(lambda _: time.monotonic() - t0 < BUDGET_S, itertools.count())
    inflight = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
        while True:
            while len(inflight) < JOBS:
                i = next(numbers, None)
                if i is None:
                    break
                inflight.append(pool.submit(case, i))
            if not inflight:
                break
            rep.add(*inflight.popleft().result())


EXTREMES = ["0", "-1", "1", "2147483647", "2147483648", "-2147483648", "4294967296",
            "9223372036854775807", "9223372036854775808", "-9223372036854775808",
            "18446744073709551615", "18446744073709551616", "1e308", "-1e308", "1e-308", "1e309",
            "nan", "-nan", "inf", "-inf", "", "0.5", "-0.0", "1e3", "0x10", "+7", "007", "9" * 40,
            "true", "list:", "list:0", "list:2147483647,1", "/dev/zero", "..", "\u00e9", "1,2,3,4"]


def mutate_deck(text, rnd):
    """One to three of: byte flips, a key/value swap, a number replaced by an extreme, an empty
    value, a cut, a duplicated or deleted line, values swapped between lines, a garbage line."""
    data = text
    what = []
    for _ in range(rnd.choice([1, 1, 1, 2, 3])):
        lines = data.split("\n")
        kv = [i for i, ln in enumerate(lines) if "=" in ln and not ln.lstrip().startswith(("#", "["))]
        op = rnd.choice(["flip", "swap", "extreme", "extreme", "extreme", "empty", "cut", "dup",
                         "delete", "crossvalue", "garbage", "nudge", "nudge"])
        if op == "flip" and data:
            b = bytearray(data.encode("utf-8", "surrogateescape"))
            for _ in range(rnd.randint(1, 4)):
                p = rnd.randrange(len(b))
                b[p] ^= 1 << rnd.randrange(8)
            data = b.decode("utf-8", "surrogateescape")
            what.append("byte flips")
        elif op == "swap" and kv:
            i = rnd.choice(kv)
            k, v = lines[i].split("=", 1)
            lines[i] = f"{v.split('#')[0].strip()} = {k.strip()}"
            data = "\n".join(lines)
            what.append(f"swap line {i + 1}")
        elif op in ("extreme", "empty") and kv:
            i = rnd.choice(kv)
            k = lines[i].split("=", 1)[0]
            v = "" if op == "empty" else rnd.choice(EXTREMES)
            lines[i] = f"{k.strip()} = {v}"
            data = "\n".join(lines)
            what.append(f"line {i + 1}: {k.strip()} = {v!r}")
        elif op == "nudge" and kv:
            # a plausible value nearby: accepted more often, so the checks after parsing run
            i = rnd.choice(kv)
            k, v = lines[i].split("=", 1)
            v = v.split("#")[0].strip()
            try:
                x = float(v)
            except ValueError:
                continue
            x = rnd.choice([x * 2, x / 2, x * 10, x / 10, x + 1, x - 1, -x])
            v = str(int(x)) if x == int(x) and abs(x) < 1e15 else repr(x)
            lines[i] = f"{k.strip()} = {v}"
            data = "\n".join(lines)
            what.append(f"line {i + 1}: {k.strip()} = {v!r}")
        elif op == "cut" and data:
            p = rnd.randrange(len(data))
            data = data[:p]
            what.append(f"cut at {p}")
        elif op == "dup" and lines:
            i = rnd.randrange(len(lines))
            lines.insert(rnd.randrange(len(lines) + 1), lines[i])
            data = "\n".join(lines)
            what.append(f"duplicate line {i + 1}")
        elif op == "delete" and lines:
            i = rnd.randrange(len(lines))
            del lines[i]
            data = "\n".join(lines)
            what.append(f"delete line {i + 1}")
        elif op == "crossvalue" and len(kv) > 1:
            i, j = rnd.sample(kv, 2)
            ki, vi = lines[i].split("=", 1)
            kj, vj = lines[j].split("=", 1)
            lines[i], lines[j] = f"{ki}={vj}", f"{kj}={vi}"
            data = "\n".join(lines)
            what.append(f"values of lines {i + 1} and {j + 1} swapped")
        elif op == "garbage":
            g = "".join(chr(rnd.choice([0, 1, 9, 13, 27, 35, 59, 61, 91, 93, 127, 0xe9, 0x2028]
                                       + list(range(32, 127)))) for _ in range(rnd.randint(1, 40)))
            lines.insert(rnd.randrange(len(lines) + 1), g)
            data = "\n".join(lines)
            what.append("garbage line")
    return data, "; ".join(what) or "unchanged"


# What keeps an accepted mutated deck cheap on 2 CPU ranks: applied on the command line for
# each key the mutation left alone (a key it changed keeps its mutated value).
CHEAP = {
    "run.eval_samples": "32", "run.eval_every": "0",
    "model.preset": "custom", "model.image_size": "8", "model.patch_size": "4", "model.hidden": "16",
    "model.depth": "2", "model.heads": "2", "model.mlp_ratio": "2", "model.num_classes": "4",
    "data.dataset": "synthetic", "data.synthetic_train": "64", "data.synthetic_eval": "32",
    "data.global_batch": "16", "data.grad_accum": "1", "data.workers": "1",
    "parallel.pipeline": "1", "parallel.tensor": "1", "parallel.micro_batches": "1",
    "parallel.chunks": "1", "parallel.schedule": "1f1b", "parallel.partition": "uniform",
    "parallel.data": "0", "checkpoint.every_steps": "0", "checkpoint.resume": "none",
    "checkpoint.load": "", "device.backend": "cpu",
}


def deck_fuzz(tmp, rep):
    sources = [TINY] + sorted(os.path.join(SRC, "inputs", n) for n in os.listdir(os.path.join(SRC, "inputs"))
                              if n.endswith(".ini"))
    texts = {s: read(s) for s in sources}
    os.makedirs(os.path.join(tmp, "decks"))
    def one(i):
        rnd = case_rng("deck", i)
        src = rnd.choice(sources)
        text, what = mutate_deck(texts[src], rnd)
        path = write(os.path.join(tmp, "decks", f"{i:05d}.ini"), text.encode("utf-8", "surrogateescape"))
        before, after = ini_values(texts[src]), ini_values(text)
        touched = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        # run.out_dir is never fuzzed: a mutated absolute path could land anywhere
        args = ["train", path, f"--run.out_dir={tmp}/o{i}"]
        stop_on = None
        if touched & {"run.steps", "run.epochs"}:
            stop_on = r"^training \d+ steps"  # accepted: no need to run it to the end
        else:
            args += ["--run.steps=2", "--run.epochs=0"]
        args += [f"--{k}={v}" for k, v in CHEAP.items() if k not in touched]
        run = launch(args, cwd=tmp, stop_on=stop_on)
        cls, reason = classify(run)
        shutil.rmtree(f"{tmp}/o{i}", ignore_errors=True)
        return os.path.basename(src), cls, reason, run, f"seed {SEED} case {i}: {what}", [path]

    execute(rep, one)


def mutate_bytes(data, rnd, hot=None):
    """Byte flips (mostly in `hot`, a (start, end) range, when given), a cut, an extension, a run
    of bytes overwritten, or several of these."""
    b = bytearray(data)
    what = []
    for _ in range(rnd.choice([1, 1, 2])):
        op = rnd.choice(["flip", "flip", "flip", "cut", "extend", "overwrite"])
        if op == "flip" and b:
            n = rnd.choice([1, 1, 2, 4, 16])
            for _ in range(n):
                lo, hi = hot if hot and rnd.random() < 0.7 else (0, len(b))
                p = rnd.randrange(lo, min(hi, len(b))) if min(hi, len(b)) > lo else rnd.randrange(len(b))
                b[p] ^= 1 << rnd.randrange(8) if rnd.random() < 0.7 else rnd.randrange(1, 256)
            what.append(f"{n} flip(s)")
        elif op == "cut" and b:
            p = rnd.randrange(len(b))
            del b[p:]
            what.append(f"cut to {p} bytes")
        elif op == "extend":
            n = rnd.choice([1, 7, 512, 3073, 4096])
            b += bytes(rnd.randrange(256) for _ in range(n)) if rnd.random() < 0.5 else bytes(n)
            what.append(f"{n} bytes appended")
        elif op == "overwrite" and b:
            p = rnd.randrange(len(b))
            n = rnd.randint(1, 64)
            b[p:p + n] = bytes([rnd.choice([0, 0xff])]) * len(b[p:p + n])
            what.append(f"{n} bytes at {p} overwritten")
    return bytes(b), "; ".join(what)


def data_fuzz(tmp, rep):
    import h5py
    bases = {"hdf5 contiguous": make_h5(tmp, "base.h5"),
             "hdf5 gzip chunks": make_h5(tmp, "base_gz.h5", chunked=True)}
    cifar = make_cifar(tmp, "cifar_base", records=4)
    # the HDF5 metadata (superblock, object headers, heaps) is where a flip matters; the pixels
    # are any bytes
    hot = {}
    for k, p in bases.items():
        with h5py.File(p, "r") as f:
            off = f["images"].id.get_offset()
        hot[k] = (0, off if off else 4096)
    jpeg = make_jpeg_sources(tmp)
    def one(i):
        rnd = case_rng("data", i)
        kind = rnd.choice(list(bases) + ["cifar10", "cifar10"] + list(jpeg) * 2)
        d = os.path.join(tmp, f"d{i}")
        os.makedirs(d)
        if kind in jpeg:
            # one file of a JPEG source mutated: an image (bad ones are replaced and counted),
            # a TFRecord shard (framing and CRCs), or the packed file (HDF5 metadata or bytes)
            base = jpeg[kind]
            if os.path.isdir(base):
                shutil.rmtree(d)
                shutil.copytree(base, d)
                files = sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs)
                target = rnd.choice(files)
                path = d
            else:
                for split in ("_train.h5", "_val.h5"):
                    shutil.copy(base[:-3] + split, os.path.join(d, "p" + split))
                target = os.path.join(d, rnd.choice(["p_train.h5", "p_val.h5"]))
                path = os.path.join(d, "p.h5")
            mutated, what = mutate_bytes(read(target, "rb"), rnd)
            write(target, mutated)
            args = [f"--data.dataset={kind}", f"--data.path={path}", "--model.image_size=32",
                    "--model.patch_size=8", "--model.num_classes=2", "--data.crop_padding=0",
                    f"--data.index_dir={d}/idx"]
            what = f"{os.path.relpath(target, d)}: {what}"
        elif kind == "cifar10":
            shutil.rmtree(d)
            shutil.copytree(cifar, d)
            name = rnd.choice([f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"])
            target = os.path.join(d, name)
            data = read(target, "rb")
            label_bytes = (0, 1)  # the first record's label byte is where labels go wrong
            mutated, what = mutate_bytes(data, rnd, hot=label_bytes if rnd.random() < 0.3 else None)
            write(target, mutated)
            args = ["--data.dataset=cifar10", f"--data.path={d}", "--model.image_size=32",
                    "--model.patch_size=8", "--model.num_classes=10"]
            what = f"{name}: {what}"
        else:
            target = os.path.join(d, "m.h5")
            mutated, what = mutate_bytes(read(bases[kind], "rb"), rnd, hot=hot[kind])
            write(target, mutated)
            args = ["--data.dataset=hdf5", f"--data.path={target}", f"--data.eval_path={target}"]
        run = launch(["train", TINY, f"--run.out_dir={d}/out", "--run.steps=2", "--checkpoint.every_steps=0",
                      "--run.eval_samples=16", "--data.workers=1"] + args, cwd=tmp)
        cls, reason = classify(run)
        saved = keep_input(tmp, i, target, cls)
        shutil.rmtree(d, ignore_errors=True)
        return kind, cls, reason, run, f"seed {SEED} case {i}: {what}", [saved]

    execute(rep, one)


def make_jpeg_sources(tmp):
    """A small JPEG set in the three forms vitgrid reads: an ImageFolder tree (the generator of
    test/data), TFRecord shards (the independent writer) and the packed pair (vitgrid_dataset)."""
    tree, tfr, packed = (os.path.join(tmp, n) for n in ("jpeg_tree", "jpeg_tfr", "jpeg_packed.h5"))
    py = os.environ.get("VG_PYTHON3", sys.executable)
    subprocess.run([py, os.path.join(SRC, "test", "data", "make_jpeg_tree.py"), tree, "--classes", "2",
                    "--train", "5", "--val", "2", "--no-bad"], check=True, capture_output=True)
    subprocess.run([py, os.path.join(SRC, "test", "data", "write_tfrecord.py"), tree, tfr, "--shards", "2"],
                   check=True, capture_output=True)
    subprocess.run([os.path.join(os.path.dirname(VITGRID), "vitgrid_dataset"), "pack", tree, packed],
                   check=True, capture_output=True)
    return {"folder": tree, "tfrecord": tfr, "jpeg_h5": packed}


def keep_input(tmp, i, path, cls):
    """A failing case's input, copied out of its directory (which goes next) for Report."""
    if cls not in FAILING or not os.path.isfile(path):
        return path
    saved = os.path.join(tmp, f"input_{i}_" + os.path.basename(path))
    shutil.copy(path, saved)
    return saved


def ckpt_fuzz(tmp, rep):
    import h5py
    ref = os.path.join(tmp, "ref")
    run = launch(["train", TINY, f"--run.out_dir={ref}", "--run.steps=20", "--checkpoint.every_steps=10"],
                 cwd=tmp, timeout=300)
    if run.rc != 0:
        print(run.out[-3000:])
        rep.add("setup", "UNCLEAN", f"the reference run failed: exit {run.rc}", run, "reference checkpoint run")
        return
    ck10 = os.path.join(ref, "checkpoints", "step_00000010.h5")
    ck20 = os.path.join(ref, "checkpoints", "step_00000020.h5")
    ref_state = snapshot(ref)
    # raw parameter bytes vs metadata: flips are aimed at the metadata 70% of the time
    raw = []
    with h5py.File(ck20, "r") as f:
        f.visititems(lambda n, o: raw.append((o.id.get_offset(), o.id.get_storage_size()))
                     if isinstance(o, h5py.Dataset) and o.id.get_offset() else None)
    first_raw = min(o for o, _ in raw) if raw else 4096
    data20 = read(ck20, "rb")

    def one(i):
        rnd = case_rng("ckpt", i)
        resume = i % 4 == 3
        d = os.path.join(tmp, f"c{i}")
        if resume:
            # a copy of the run whose newest checkpoint is damaged: resuming must refuse it
            # cleanly or fall back, and never lose the complete step 10
            shutil.copytree(ref, d)
            target = os.path.join(d, "checkpoints", "step_00000020.h5")
        else:
            os.makedirs(d)
            target = os.path.join(d, "m.h5")
        mutated, what = mutate_bytes(data20, rnd, hot=(0, first_raw))
        write(target, mutated)
        keep10 = sha(ck10)
        before = sha(target)
        if resume:
            args = ["train", TINY, f"--run.out_dir={d}", "--checkpoint.resume=auto", "--run.steps=22",
                    "--checkpoint.every_steps=0"]
        else:
            args = ["eval", TINY, f"--checkpoint.load={target}", f"--run.out_dir={d}/ev"]
        run = launch(args, cwd=tmp)
        cls, reason = classify(run)
        lost = []
        if snapshot(ref) != ref_state:
            lost.append("the reference run directory changed")
        if resume:
            c10 = os.path.join(d, "checkpoints", "step_00000010.h5")
            if not os.path.exists(c10):
                lost.append("step_00000010.h5 (complete) is gone")
            elif sha(c10) != keep10:
                lost.append("step_00000010.h5 (complete) was modified")
        elif not os.path.exists(target) or sha(target) != before:
            lost.append("eval changed the checkpoint it loaded")
        if lost and cls not in ("CRASH", "HANG"):
            cls, reason = "LOST", "; ".join(lost)
        saved = keep_input(tmp, i, target, cls)
        shutil.rmtree(d, ignore_errors=True)
        return ("resume (train)" if resume else "load (eval)", cls, reason, run,
                f"seed {SEED} case {i}: {what}", [saved])

    execute(rep, one)


def main():
    name = sys.argv[1]
    fn = {"corpus": corpus, "deck_fuzz": deck_fuzz, "data_fuzz": data_fuzz, "ckpt_fuzz": ckpt_fuzz}[name]
    tmp = tempfile.mkdtemp(prefix=f"vg_faults_{name}_")  # noqa: S108
    print(f"faults {name}: seed {SEED}, budget {BUDGET_S:.0f} s, run timeout {RUN_TIMEOUT:.0f} s, "
          f"binary {VITGRID}, temp dir {tmp}", flush=True)
    rep = Report(name, tmp)
    fn(tmp, rep)
    ok = rep.summary()
    if ok and os.environ.get("VG_FAULTS_KEEP") != "1":
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"\ntemp dir kept: {tmp}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
