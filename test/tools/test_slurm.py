#!/usr/bin/env python3
"""The batch scripts under a real SLURM: munged, slurmctld and slurmd started on localhost from a
config generated in a temporary directory (Debian's slurm-wlm + munge, `make deps`), CPU only.

1. jobs/slurm_1node.sbatch with inputs/quickstart.ini (a short run), submitted from the checkout
   by a relative path to run in a directory outside it (--chdir), --run.out_dir= among the
   overrides: exit 0, metrics rows 1..N, srun --mpi=pmix found although MpiDefault=none.
2. the same submitted by full path from outside the checkout, the run directory from
   VITGRID_RUN_DIR: once a checkpoint exists, `scancel --signal=USR1 --batch`;
   the step exits 3, the script requeues the job, the requeued job resumes and completes with
   /train/step = 1..N exactly once, and the job's .out file (--open-mode=append) holds both
   segments.
The daemons are stopped by PID whatever happens, and any process left from the test's jobs is
killed. Exit 77 (skipped) when SLURM cannot be started here (not root, packages missing).
Run by ctest with VITGRID_BIN and VITGRID_SOURCE_DIR set."""
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import tool_check
from tool_check import ROOT, check, finish

DEADLINE = time.monotonic() + 210  # ctest's timeout is 240 s
STEPS1, STEPS2, EVERY2 = 40, 400, 25


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


if os.geteuid() != 0:
    skip("the test daemons (munged, slurmctld, slurmd) need root")
for prog in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun", "sinfo"):
    if not shutil.which(prog, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
        skip(f"'{prog}' not found: install slurm-wlm and munge (make deps)")
try:
    import h5py
except ImportError:
    skip(f"no h5py in {sys.executable}")
VITGRID_BIN = os.environ.get("VITGRID_BIN", os.path.join(ROOT, "build", "bin", "vitgrid"))
if not os.access(VITGRID_BIN, os.X_OK):
    skip(f"no vitgrid executable at {VITGRID_BIN}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sbin(prog):
    return shutil.which(prog, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


tmp = tempfile.mkdtemp(prefix="vg-slurm-")
os.chmod(tmp, 0o700)
host = socket.gethostname().split(".")[0]
cpus = len(os.sched_getaffinity(0))
conf = os.path.join(tmp, "slurm.conf")
sock = os.path.join(tmp, "munge.socket")
for d in ("state", "spool", "submit", "log", "tmpfs"):
    os.mkdir(os.path.join(tmp, d))
with open(conf, "w") as f:
    f.write(f"""ClusterName=vgtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
TmpFS={tmp}/tmpfs
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/log/slurmctld.log
SlurmdLogFile={tmp}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=10
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
# every process of the test carries this tag in its environment: anything left is found by it
TAG = f"VG_SLURM_TEST={tmp}"
env = dict(os.environ, SLURM_CONF=conf, VG_SLURM_TEST=tmp, VITGRID_BIN=VITGRID_BIN)
for k in list(env):
    if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
        del env[k]  # a test run inside a SLURM job must not hand its job's settings on
env.pop("VITGRID_HOME", None)
env.pop("VITGRID_ROOT", None)
daemons = []
jobs = []


def start(cmd):
    out = open(os.path.join(tmp, "log", os.path.basename(cmd[0]) + ".stdout"), "w")
    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True)
    daemons.append(p)
    return p


def sh(*cmd, timeout=30):
    return subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout)


def job_info(jid):
    p = sh("scontrol", "show", "job", "-o", str(jid))
    return dict(re.findall(r"(\w+)=(\S*)", p.stdout)) if p.returncode == 0 else {}


def wait_for(what, cond, limit):
    end = min(time.monotonic() + limit, DEADLINE)
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.25)
    raise TimeoutError(f"timed out waiting for {what}")


def wait_done(jid, limit):
    def done():
        i = job_info(jid)
        return i if i.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                          "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL") else None
    try:
        return wait_for(f"job {jid} to end", done, limit)
    except TimeoutError:
        print(sh("scontrol", "show", "job", str(jid)).stdout)
        raise


def steps_of(run_dir):
    path = os.path.join(run_dir, "metrics.h5")
    if not os.path.exists(path):
        return []
    with h5py.File(path, "r") as f:
        return [int(s) for s in f["/train/step"][()]] if "/train/step" in f else []


def show_logs():
    for path in sorted(glob.glob(os.path.join(tmp, "log", "*")) +
                       glob.glob(os.path.join(tmp, "submit", "*.out"))):
        with open(path, errors="replace") as f:
            print(f"---- {path} (tail)\n" + "".join(f.readlines()[-25:]))


def stop_everything():
    """Cancels the jobs, stops the daemons by PID, kills what is left of the jobs."""
    for jid in jobs:
        try:
            sh("scancel", str(jid), timeout=10)
        except Exception:
            pass
    if jobs:
        try:
            end = time.monotonic() + 15
            while time.monotonic() < end and sh("squeue", "-h", timeout=10).stdout.strip():
                time.sleep(0.5)
        except Exception:
            pass
    for p in reversed(daemons):  # slurmd, slurmctld, then munged
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    # slurmstepd and job processes outlive slurmd: find them by the tag in their environment
    for _ in range(3):
        left = []
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
            if pid == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if TAG.encode() in f.read().split(b"\0"):
                        left.append(pid)
            except OSError:
                pass
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not left:
            break
        time.sleep(0.5)


t0 = time.monotonic()
ok_all = False
try:
    key = os.path.join(tmp, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    start([sbin("munged"), "-F", "--force", f"--socket={sock}", f"--key-file={key}",
           f"--pid-file={tmp}/munged.pid", f"--log-file={tmp}/log/munged.log",
           f"--seed-file={tmp}/munged.seed"])
    try:
        wait_for("munged's socket", lambda: os.path.exists(sock) or daemons[0].poll() is not None, 10)
    except TimeoutError:
        pass
    if not os.path.exists(sock):
        show_logs()
        skip("munged did not start")
    start([sbin("slurmctld"), "-D", "-i", "-f", conf])
    start([sbin("slurmd"), "-D", "-f", conf, "-N", host])
    try:
        wait_for("the node to be idle",
                 lambda: sh("sinfo", "-h", "-o", "%t").stdout.strip() == "idle", 30)
    except TimeoutError:
        show_logs()
        skip("slurmctld/slurmd did not bring the node up (see the logs above)")
    print(f"ok   SLURM up in {time.monotonic() - t0:.1f} s ({cpus} CPUs, {host})")

    submit = os.path.join(tmp, "submit")  # outside the checkout: paths come from the script
    script = os.path.join(ROOT, "jobs", "slurm_1node.sbatch")

    # ---- 1: a short run, --run.out_dir among the overrides
    run1 = os.path.join(tmp, "run1")
    # submitted from the checkout with a relative path, run in a directory outside it
    p = subprocess.run(["sbatch", "--parsable", f"--chdir={submit}", "--time=5",
                        os.path.join("jobs", "slurm_1node.sbatch"), "inputs/quickstart.ini",
                        f"--run.steps={STEPS1}", "--checkpoint.every_steps=0", f"--run.out_dir={run1}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    check(p.returncode == 0, f"sbatch jobs/slurm_1node.sbatch --chdir={submit}: {p.stdout.strip()} {p.stderr.strip()}")
    jid1 = int(p.stdout.strip().split(";")[0])
    jobs.append(jid1)
    info = wait_done(jid1, 90)
    log1 = os.path.join(submit, f"vitgrid-{jid1}.out")
    text1 = open(log1).read() if os.path.exists(log1) else ""
    steps = steps_of(run1)
    check(info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0",
          f"job {jid1}: {info.get('JobState')}, exit {info.get('ExitCode')}")
    check(steps == list(range(1, STEPS1 + 1)), f"job {jid1}: metrics rows 1..{STEPS1} ({len(steps)} rows)")
    check("--mpi=pmix" in text1, "srun --mpi=pmix detected (MpiDefault=none in slurm.conf)")
    check(f"run dir {run1}" in text1, "--run.out_dir= among the overrides is the run dir")

    # ---- 2: submitted by full path from outside the checkout; preempted once a checkpoint
    # exists, requeued, resumed
    run2 = os.path.join(tmp, "run2")
    p = subprocess.run(["sbatch", "--parsable", "--time=5", script, "inputs/quickstart.ini",
                        f"--run.steps={STEPS2}",
                        f"--checkpoint.every_steps={EVERY2}", "--run.eval_every=0"],
                       cwd=submit, env=dict(env, VITGRID_RUN_DIR=run2), capture_output=True,
                       text=True, timeout=30)
    check(p.returncode == 0, f"sbatch {script} with VITGRID_RUN_DIR: {p.stdout.strip()} {p.stderr.strip()}")
    jid2 = int(p.stdout.strip().split(";")[0])
    jobs.append(jid2)
    ckpt = wait_for("a first checkpoint",
                    lambda: sorted(glob.glob(os.path.join(run2, "checkpoints", "step_*.h5"))), 60)
    p = sh("scancel", "--signal=USR1", "--batch", str(jid2))
    check(p.returncode == 0, f"scancel --signal=USR1 --batch {jid2} after {os.path.basename(ckpt[-1])}")
    wait_for(f"job {jid2} to be requeued", lambda: int(job_info(jid2).get("Restarts", "0")) >= 1
             and job_info(jid2).get("JobState") == "PENDING", 60)
    # SLURM holds a requeued job for 2 minutes (its EligibleTime): let it start sooner, but not
    # within the second the old segment's credential was revoked (slurmd would refuse the
    # launch: "Job credential revoked")
    time.sleep(3)
    p = sh("scontrol", "update", f"JobId={jid2}", "StartTime=now")
    check(p.returncode == 0, f"requeued job {jid2} released (scontrol update StartTime=now) {p.stderr.strip()}")
    info = wait_done(jid2, 120)
    log2 = os.path.join(submit, f"vitgrid-{jid2}.out")
    text2 = open(log2).read() if os.path.exists(log2) else ""
    steps = steps_of(run2)
    check(info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0" and info.get("Restarts") == "1",
          f"job {jid2}: {info.get('JobState')}, exit {info.get('ExitCode')}, restarts {info.get('Restarts')}")
    check("srun exited 3" in text2 and "requeueing" in text2,
          "the preempted segment exited 3 and requeued the job")
    m = re.search(r"after step (\d+)", text2)
    check(m is not None and 0 < int(m.group(1)) < STEPS2, f"vitgrid's preemption line: {m.group(0) if m else None}")
    check("restart 0 " in text2 and "restart 1 " in text2 and text2.rstrip().endswith("srun exited 0"),
          "the .out file holds both segments (--open-mode=append)")
    check(steps == list(range(1, STEPS2 + 1)),
          f"resumed run: /train/step = 1..{STEPS2} exactly once ({len(steps)} rows, "
          f"{len(set(steps))} distinct, max {max(steps) if steps else None})")
    ok_all = True
except Exception as e:  # a timeout or a failed command: report, then clean up
    check(False, f"{type(e).__name__}: {e}")
finally:
    if not ok_all or tool_check._failed:
        show_logs()
    stop_everything()
    left = [p.pid for p in daemons if p.poll() is None]
    check(not left, f"daemons stopped (PIDs {[p.pid for p in daemons]}) in {time.monotonic() - t0:.1f} s")
    shutil.rmtree(tmp, ignore_errors=True)
finish()  # (after a skip inside the try, SystemExit(77) has left already, the daemons stopped)
