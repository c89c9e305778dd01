"""Run one shell command in a sandbox with limits: the execution half of the `shell` env.

`await Sandbox(workdir, limits=Limits(...), isolation="bwrap").run(command)` runs
`bash -c COMMAND` in `workdir` and returns a `CommandResult` (output, exit code, which
limit if any was hit, elapsed time). Each command is its own sandbox: nothing it starts
outlives it (with bwrap the command's PID namespace dies with it), and no state but the
files in `workdir` carries over to the next command.

Isolation `"bwrap"` (bubblewrap; `ensure_bwrap()` installs the Debian package when it is
missing and we are root, then checks that a sandbox starts). What holds:
- filesystem: only the system's directories are there, read-only (`SYSTEM_DIRS`:
  /usr, /etc, and /bin, /sbin, /lib... as the host has them, directories or links);
  nothing else of the host is (no home directories, /root, /srv, /mnt, /var, /opt or
  wherever a checkout of gyre, its tasks or another run's files may live); the
  workdir, mounted at /home/agent (also the cwd and HOME), is the only writable place
  (with the empty private tmpfs `/tmp`, `/var/tmp`, `/run`, `/home`); each of
  `hide_paths` under a system directory is an empty tmpfs too (e.g. the task
  folders of a gyre installed under /usr); `/dev` is a minimal private one, `/proc`
  the sandbox's own, `/` itself a read-only tmpfs. The sandbox never depends on where
  the caller's files are: a checkout under /tmp or under a directory the sandbox's
  user cannot enter works the same;
- network: a private network namespace with only a loopback device (no route to the
  host's or anyone's TCP/UDP ports, the host's 127.0.0.1 included), and a seccomp
  filter that refuses `socket(AF_UNIX, ...)` and `io_uring_setup` (so the host's
  filesystem Unix sockets, which a read-only mount does not protect, are unreachable);
- processes: private PID, IPC, UTS, cgroup and user namespaces, a new session (no
  terminal injection), no capabilities, a clean environment (PATH, HOME, LANG, TERM).
  As root, bwrap does the mounts as root and the command then becomes `sandbox_uid`
  (default 65534, "nobody") in a user namespace of its own (`drop_argv`): root-only
  files are not even readable, and RLIMIT_NPROC applies (the kernel exempts root).
  As another user, bwrap runs unprivileged (user namespaces must be allowed), the
  command keeps that user's uid and cannot make further user namespaces;
- limits (`prlimit`, inside the sandbox, per process): CPU seconds (RLIMIT_CPU),
  address space (RLIMIT_AS), file size (RLIMIT_FSIZE), processes (RLIMIT_NPROC,
  counted per sandbox thanks to its user namespace), no core files; plus wall time
  (the process group is killed; the PID namespace dies with it), an output cap
  (stdout+stderr merged; past `output_bytes` the command is killed) and a disk budget:
  the workdir, the one writable place, holds at most `disk_mb` (measured while the
  command runs, every `DISK_POLL_S` or more, and once it ends; every file and folder
  counts at least one 4 KiB block, so a flood of empty files is counted too); past it
  the command is killed. RLIMIT_FSIZE bounds one file, not how many: without the budget
  a command writing many 64 MB files filled the node's disk.
What does not hold: reads within the system directories are not restricted (their
world-readable files, e.g. the Python installation and /etc, are visible); RLIMIT_AS is per process,
so N processes may use N x memory_mb (no cgroup); the "memory" reason is inferred from
the output (MemoryError, "Cannot allocate memory", ...), since a failed allocation is
not a signal; CPU time past the soft limit is SIGXCPU, but a SIGKILL at the hard limit
(one second later) reads as an ordinary kill.

A container image (`image=`, a task's `image:`): the command runs in it with Charliecloud's
ch-run inside this same sandbox, limits and all (`gyre_slurm.envs.container`).

Isolation `"none"` runs the command directly in `workdir` with the same limits and
clean environment, but NO filesystem or network isolation: only for trusted commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.common.debian import which_or_install
from gyre_slurm.envs import container
from gyre_slurm.errors import UserError

ISOLATIONS = ("bwrap", "none")
NOBODY_UID = 65534
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_HOME = "/home/agent"  # where the workdir appears inside the sandbox (and HOME)
HIDDEN = ("/tmp", "/var/tmp", "/run", "/home")  # empty private tmpfs in the sandbox
# The host's directories the sandbox sees (read-only; a link, as on merged-/usr systems,
# stays a link): what programs need to run, and nothing of anyone's files.
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "memory exhausted",
                  "std::bad_alloc", "out of memory")


class SandboxError(RuntimeError):
    """The sandbox cannot be set up here (bwrap missing or not working)."""


@dataclass(frozen=True)
class Limits:
    """Per-command limits. `time_s`: wall clock (then the process group is killed);
    `cpu_s`: CPU seconds per process; `memory_mb`: address space per process;
    `fsize_mb`: largest file a process may write; `nproc`: processes (and threads) in
    the sandbox; `output_bytes`: stdout+stderr kept before the command is killed;
    `disk_mb`: what the workdir may hold (see the module docstring)."""

    time_s: float = 30.0
    cpu_s: int = 30
    memory_mb: int = 1024
    fsize_mb: int = 64
    nproc: int = 128
    output_bytes: int = 16_384
    disk_mb: int = 1024

    def __post_init__(self) -> None:
        for name in ("time_s", "cpu_s", "memory_mb", "fsize_mb", "nproc", "output_bytes",
                     "disk_mb"):
            if not getattr(self, name) > 0:
                raise UserError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")

    def prlimit_argv(self) -> list[str]:
        mib = 1 << 20
        return ["prlimit", f"--cpu={self.cpu_s}:{self.cpu_s + 1}",
                f"--as={self.memory_mb * mib}",
                f"--fsize={min(self.fsize_mb, self.disk_mb) * mib}",  # no file past the budget
                f"--nproc={self.nproc}", "--core=0", "--"]


@dataclass(frozen=True)
class CommandResult:
    output: str  # stdout+stderr, at most output_bytes (decoded, bad bytes replaced)
    exit_code: int | None  # None when we killed it (time, output or disk limit)
    limit: str | None  # "time" | "output" | "disk" | "cpu" | "memory" | "fsize" | None
    elapsed_s: float


BLOCK = 4096  # the least a file or folder is counted for (an inode and a block)
DISK_POLL_S = 0.5  # the disk budget's check while a command runs (longer if a check is slow)


def disk_usage(*roots: Path, cap: int) -> int:
    """Bytes the trees of `roots` take (their blocks, each entry at least BLOCK, each
    inode once; a root may be a file: a log), counted until past `cap` (then a number >
    cap: the walk stops there, so a tree of a million files costs no more than the
    budget's worth of entries). A folder the sandbox made unreadable to its owner is
    made readable again (it is ours)."""
    total, seen, stack = 0, set(), []
    for root in roots:
        try:
            st = os.stat(root, follow_symlinks=False)
        except OSError:  # not made yet, or gone
            continue
        if os.path.isdir(root) and not os.path.islink(root):
            stack.append(str(root))
        elif (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += max(st.st_blocks * 512, BLOCK)
    while stack:
        path = stack.pop()
        try:
            it = os.scandir(path)
        except PermissionError:
            try:
                os.chmod(path, 0o700)
                it = os.scandir(path)
            except OSError:
                continue
        except OSError:  # gone meanwhile
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                total += max(st.st_blocks * 512, BLOCK)
                if total > cap:
                    return total
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return total


async def over_disk(*roots: Path, disk_mb: int) -> bool:
    """Whether `roots` hold more than `disk_mb` (`disk_usage`, in a thread)."""
    cap = disk_mb << 20
    return await asyncio.to_thread(disk_usage, *roots, cap=cap) > cap


async def watch_disk(*roots: Path, disk_mb: int, proc) -> bool:
    """True once `roots` hold more than `disk_mb` while `proc` runs (checked every
    DISK_POLL_S, or four times as long as a check took); False when `proc` ended first."""
    while proc.returncode is None:
        t0 = time.monotonic()
        if await over_disk(*roots, disk_mb=disk_mb):
            return True
        await asyncio.sleep(max(DISK_POLL_S, 4 * (time.monotonic() - t0)))
    return False


def limit_hit(exit_code: int | None, output: str) -> str | None:
    """Which rlimit (if any) ended a command, from its exit status and output."""
    if exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU) or "CPU time limit exceeded" in output:
        return "cpu"
    if exit_code in (128 + signal.SIGXFSZ, -signal.SIGXFSZ) or "File size limit exceeded" in output:
        return "fsize"
    if exit_code and any(m in output for m in MEMORY_MARKERS):
        return "memory"
    return None


# Seccomp (classic BPF, as bwrap --seccomp takes it): refuse socket(AF_UNIX, ...) and
# io_uring_setup with EACCES, and any syscall of a foreign ABI (x32, i386) with ENOSYS.
_ARCHS = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}  # audit arch, __NR_socket
_NR_IO_URING_SETUP = 425
_X32_BIT = 0x40000000


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture, or None where we have no table."""
    arch = _ARCHS.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, nr_socket = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, eacces, enosys = 0x7FFF0000, 0x00050000 | 13, 0x00050000 | 38
    prog = [
        (ld, 0, 0, 4),                        # 0: A = arch
        (jeq, 1, 0, audit_arch),              # 1: native -> 3
        (ret, 0, 0, enosys),                  # 2: foreign ABI
        (ld, 0, 0, 0),                        # 3: A = nr
        (jge, 6, 0, _X32_BIT),                # 4: x32 -> 11 (ENOSYS)
        (jeq, 3, 0, _NR_IO_URING_SETUP),      # 5: -> 9 (EACCES)
        (jeq, 0, 3, nr_socket),               # 6: socket? else -> 10 (allow)
        (ld, 0, 0, 16),                       # 7: A = low word of args[0] (domain)
        (jeq, 0, 1, 1),                       # 8: AF_UNIX? -> 9, else -> 10
        (ret, 0, 0, eacces),                  # 9
        (ret, 0, 0, allow),                   # 10
        (ret, 0, 0, enosys),                  # 11
    ]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def bwrap_argv(workdir: Path | None, *, hide_paths: tuple[str, ...] = (),
               seccomp_fd: int | None = None, privileged: bool = False,
               image: Path | None = None) -> list[str]:
    """The bwrap command line (up to the inner command): `workdir` becomes the writable
    SANDBOX_HOME (None: nothing writable, in `/`). `privileged` (we are root): bwrap
    keeps root for the mounts and the inner command drops it (`drop_argv`); otherwise
    bwrap makes an unprivileged user namespace. `image`: a container image shown for
    ch-run (`gyre_slurm.envs.container`), which makes the user namespace itself."""
    argv = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try"]
    if not privileged:
        argv += ["--unshare-user"] + ([] if image is not None else ["--disable-userns"])
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox",
             *system_mounts(), "--dev", "/dev", "--proc", "/proc"]
    for p in HIDDEN + tuple(p for p in hide_paths
                            if _under(p, SYSTEM_DIRS) and not _under(p, HIDDEN)):
        argv += ["--tmpfs", p]
    home = "/" if workdir is None else SANDBOX_HOME
    if workdir is not None:
        argv += ["--bind", str(workdir), home]
    if image is not None:
        argv += container.bwrap_mounts(image)
    argv += ["--remount-ro", "/"]  # the root tmpfs, once every mount point is made
    argv += ["--chdir", home, "--clearenv", "--setenv", "PATH", SANDBOX_PATH,
             "--setenv", "HOME", home, "--setenv", "LANG", "C.UTF-8", "--setenv", "TERM", "dumb"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv


def system_mounts() -> list[str]:
    """bwrap arguments that show the host's SYSTEM_DIRS read-only (links as links)."""
    argv: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    return argv


def drop_argv(uid: int, *, userns: bool = True) -> list[str]:
    """Inside a privileged bwrap: become `uid` with no capabilities, in a user namespace
    of its own (so RLIMIT_NPROC, set after it, counts this sandbox's processes only;
    `userns=False` when ch-run makes that namespace)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"] + (["unshare", "--user", "--"] if userns else [])


def _under(path: str, roots: tuple[str, ...]) -> bool:
    p = Path(path)
    return any(p == Path(r) or Path(r) in p.parents for r in roots)


def default_sandbox_uid() -> int:
    return NOBODY_UID if os.geteuid() == 0 else os.geteuid()


def ensure_bwrap(*, install: bool = True) -> str:
    """The path of a working `bwrap`; installs the Debian package `bubblewrap` with
    apt-get when missing (as root), then starts a trivial sandbox. `SandboxError` with
    the reason and the fix otherwise."""
    path = which_or_install("bwrap", "bubblewrap", install=install)
    if path is None:
        raise SandboxError("bubblewrap (bwrap) is not installed and could not be installed; "
                           "install the `bubblewrap` package, or pass isolation='none' for "
                           "trusted tasks only (no filesystem or network isolation)")
    if path not in _PROBED:
        probe = Sandbox(Path("/"), limits=Limits(time_s=60), isolation="bwrap")
        argv = probe.argv("true", workdir=None)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            raise SandboxError(
                f"bwrap cannot start a sandbox here: {proc.stderr.strip()[-400:]}; unprivileged "
                "user namespaces may be disabled (sysctl user.max_user_namespaces, "
                "kernel.unprivileged_userns_clone, or AppArmor's "
                "kernel.apparmor_restrict_unprivileged_userns)")
        _PROBED.add(path)
    return path


_PROBED: set[str] = set()


class Sandbox:
    """Runs commands in `workdir` under `limits` with the chosen isolation."""

    def __init__(self, workdir: Path, *, limits: Limits, isolation: str = "bwrap",
                 hide_paths: tuple[str, ...] = (), sandbox_uid: int | None = None,
                 image: Path | None = None):
        if isolation not in ISOLATIONS:
            raise UserError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if image is not None and isolation != "bwrap":
            raise UserError("a container image runs inside the bwrap sandbox: isolation "
                            f"must be bwrap, got {isolation!r}")
        self.image = None if image is None else container.check_image(image)
        if self.image is not None:
            container.ensure_charliecloud()
        self.workdir = Path(workdir)
        self.limits, self.isolation = limits, isolation
        self.hide_paths = tuple(hide_paths)
        self.uid = default_sandbox_uid() if sandbox_uid is None else sandbox_uid
        self.privileged = os.geteuid() == 0
        if not self.privileged and self.uid != os.geteuid():
            raise UserError(f"sandbox_uid {self.uid}: only root can run the sandbox as "
                            "another user")
        if self.privileged and self.uid == 0 and isolation == "bwrap":
            raise UserError("sandbox_uid must not be 0: the sandbox never runs as root")

    def argv(self, command: str, *, workdir: Path | None, seccomp_fd: int | None = None,
             env_extra: dict[str, str] | None = None) -> list[str]:
        env = dict(env_extra or {})
        if self.image is None:
            run = ["bash", "-c", command]
        else:  # ch-run mounts the workdir from HOME: the command's HOME is set inside
            run = container.run_argv(command, home=env.pop("HOME", SANDBOX_HOME))
            env["USER"] = container.CONTAINER_USER
        inner = self.limits.prlimit_argv() + run
        if self.isolation == "none":
            return inner
        outer = bwrap_argv(workdir, hide_paths=self.hide_paths, seccomp_fd=seccomp_fd,
                           privileged=self.privileged, image=self.image)
        for k, v in env.items():
            outer += ["--setenv", k, v]
        drop = drop_argv(self.uid, userns=self.image is None) if self.privileged else []
        return outer + drop + inner

    async def run(self, command: str, *, env_extra: dict[str, str] | None = None,
                  pass_fds: tuple[int, ...] = ()) -> CommandResult:
        """`env_extra`: more environment variables; `pass_fds`: descriptors the command
        inherits (e.g. a private channel for test results)."""
        t0 = time.monotonic()
        seccomp_fd, kwargs = None, {"pass_fds": tuple(pass_fds)}
        if self.isolation == "bwrap":
            prog = seccomp_program()
            if prog is not None:
                seccomp_fd = os.memfd_create("gyre-seccomp", 0)
                os.write(seccomp_fd, prog)
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
                kwargs["pass_fds"] += (seccomp_fd,)
        else:
            kwargs["env"] = {"PATH": SANDBOX_PATH, "HOME": str(self.workdir), "LANG": "C.UTF-8",
                             "TERM": "dumb", **(env_extra or {})}
        # Our own pipe (not asyncio's): we close our end when done, so a command that is
        # killed mid-flood, or a grandchild that keeps the pipe, never blocks `wait()`.
        rfd, wfd = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(command, workdir=self.workdir, seccomp_fd=seccomp_fd,
                           env_extra=env_extra),
                cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=wfd, stderr=wfd,
                start_new_session=True, **kwargs)
        except BaseException:
            os.close(rfd)
            raise
        finally:
            os.close(wfd)
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(rfd, "rb", buffering=0))
        full = asyncio.Event()
        watch = asyncio.create_task(self._watch_disk(proc, full))
        try:
            out, limit = await self._collect(proc, reader)
        finally:
            watch.cancel()
            transport.close()
            # bwrap: the PID namespace ends with the command; none: kill what it left
            if proc.returncode is None or self.isolation == "none":
                _kill_group(proc)
            await proc.wait()
        if full.is_set() or await self._over_disk():
            limit = "disk"  # (the check after it ends: a command shorter than a poll)
        code = None if limit in ("time", "output", "disk") else proc.returncode
        text = out.decode("utf-8", errors="replace")
        return CommandResult(output=text, exit_code=code, limit=limit or limit_hit(code, text),
                             elapsed_s=time.monotonic() - t0)

    async def _over_disk(self) -> bool:
        return await over_disk(self.workdir, disk_mb=self.limits.disk_mb)

    async def _watch_disk(self, proc, full: asyncio.Event) -> None:
        """Kill the command once the workdir holds more than `disk_mb`."""
        if await watch_disk(self.workdir, disk_mb=self.limits.disk_mb, proc=proc):
            full.set()
            _kill_group(proc)

    async def _collect(self, proc, reader) -> tuple[bytes, str | None]:
        """Read merged output until EOF; ("time"|"output") when a limit cut it short."""
        cap, buf = self.limits.output_bytes, bytearray()

        async def read() -> str | None:
            while chunk := await reader.read(65536):
                buf.extend(chunk)
                if len(buf) > cap:
                    del buf[cap:]
                    return "output"
            return None

        deadline = time.monotonic() + self.limits.time_s
        try:
            limit = await asyncio.wait_for(read(), timeout=self.limits.time_s)
            if limit is None:  # output closed: the command is ending, still within time
                await asyncio.wait_for(proc.wait(), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return bytes(buf), "time"
        return bytes(buf), limit


def _kill_group(proc) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
