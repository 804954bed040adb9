"""The program a ``code-repair-v1`` test run runs (``RUNNER``, started by
:mod:`envpool.envs.code_repair_runner` as ``python -I -B -u -c RUNNER ...``): its keeper, the
PID namespace's init and the runner that imports the policy's module and evaluates the
checks. Kept apart from the host side because it is a program of its own, run in the run's
processes and never imported there; the comment below says how it runs."""

# Runs as `python -I -B -u -c RUNNER PARENT_PID RESULTS_FD DONE_FD ISOLATE SHM_BYTES UID_BASE` in the work
# dir, with the module's name, the test file's imports and the checks' calls as one JSON line on stdin
# (never the expected values). It writes one JSON line per check to RESULTS_FD, a file of its
# own: {"i", "value"}, or {"i", "raised": [the exception's class names, its MRO], "message",
# "at"}, or {"i", "not_plain": type, "repr"}; an import failure is {"import_error", "at"}.
# Unbuffered (-u): the module's prints reach the output as they are made, since the runner is
# killed after its results (or at the timeout), never left to flush a buffer.
#
# Three roles, so that nothing the module starts outlives the run, however it ends:
# * the keeper (the process started here) never runs the module's code, so the module cannot
#   end it by ending the interpreter or crashing. It dies with the process that started it
#   (PR_SET_PDEATHSIG, set here rather than in a preexec_fn, which is not safe in a process
#   with threads, as a container's server is), reads the spec (after its parent set its
#   limits, which its children inherit), and forks;
# * with ISOLATE, where unshare(CLONE_NEWPID) works (with CAP_SYS_ADMIN, as root has; else in
#   a user namespace of its own that maps only its own uid and gid, where the kernel and the
#   seccomp filter let it make one: not under Docker's default profile), its child is pid 1
#   of a fresh PID namespace: an init that only reaps. When it ends (the runner ended, or it
#   was killed) the kernel kills every process of the namespace, whatever its session,
#   process group or working directory. Nothing in the namespace can signal it (it has no
#   handler), nor any process outside (kill(-1) included), since none has a pid there. Where
#   it can, the keeper takes a mount namespace too, with a tmpfs of the run's own on /dev/shm
#   (at most SHM_BYTES, the run's memory): what the run wrote there (memory, charged to its
#   memory cgroup) goes with its last process, rather than stay charged to the container run
#   after run, and no later episode reads it; and the init, a process of the new PID
#   namespace, mounts that namespace's proc on /proc there (nosuid, nodev, noexec), so that
#   the module lists the run's own processes alone, never the container's (their command
#   lines, the server's); its sys, sysrq-trigger, irq, bus and fs read-only, as Docker makes
#   them (a module as uid 0 writes a sysctl as its owner, capabilities or none: the host's
#   core_pattern), or no proc of the run's own. Where it can too, the keeper takes a network
#   namespace (on either route): no interface but a loopback that is down, so the module
#   reaches no localhost service (the env server's own TCP port, in a container with a
#   network of its own: --tcp), no other host and no abstract Unix socket (those belong to a
#   network namespace). A Unix socket with a path is a file, not the network namespace's: it
#   stays reachable as its file's permissions allow (the module's uid's, and a dir above it
#   that it may search). Each of these refused, the run runs without it, as before, and the
#   host is told (below). In a container that masks paths under /proc (Docker's, podman's:
#   other mounts over some of its files) the kernel refuses a fresh proc to a user
#   namespace: there the run's own /proc needs the root route. The runner takes a session of
#   its own there (the keeper and the init stay in the env server's process group), so that
#   a module run as the server's own user, or as root, no longer signals the server by its
#   group (kill(0), killpg(getpgid(0))): such a signal reaches the runner and what the module
#   started, no more;
# * the runner, under that init (or the keeper's child where there is no namespace), imports
#   the module and evaluates the checks. When done it writes one byte to DONE_FD and waits
#   on the spec's pipe (moved off fd 0, which reads /dev/null for the module), alive, so that
#   its parent kills the whole tree (kill_tree) after every run, not only on a timeout.
#   With a UID_BASE (not "-": the parent is root, code_repair_user), the runner first takes
#   the run's own uid, UID_BASE + the keeper's pid, with a group of its own and no
#   supplementary groups, for good (real, effective and saved ids), and no_new_privs (a
#   set-uid program in the container runs as that uid): after the namespaces and
#   the mounts, which need root, and after its parent put the tree in its cgroups, before the
#   module is imported (a library under a dir of root's alone is bind-mounted first, on the
#   run's own tmpfs: mount_library). The keeper and the init stay root, out of the module's
#   reach. Where the ids cannot be taken (or the library cannot be mounted) it writes
#   {"uid_error"} and ends, never running the module as root; and it skips the
#   user-namespace route below, whose map holds only root. Without a UID_BASE (the module runs
#   as the keeper's uid: root, the user namespace's root, or a server that is not root) the
#   runner drops every capability it holds instead, at the same point: it held them all in its
#   namespace (root's, or the user namespace's), enough to ptrace the init (in the server's
#   process group: it made it kill that group), unmount the run's /proc (and, through the
#   container's, write the keeper's memory) and setns into the server's network namespace. No
#   capability effective, permitted, inheritable or ambient is left, and no_new_privs is set,
#   so that no exec (a set-uid program, a file's capabilities, root's own execve) gives one
#   back; the bounding set is emptied too where CAP_SETPCAP allows. Where that fails it writes
#   {"caps_error"} and ends. A server that is not root, without a user namespace, holds none:
#   nothing to drop.
#
# The runner's first byte on DONE_FD, written before the module is imported, is the run's
# isolation (its high bit set; a done byte has none): whether it got a PID, a mount and a
# network namespace of its own, its own /proc and /dev/shm, and whether the module holds no
# capability. Nothing of the module's has run then, so nothing of it wrote that pipe first
# (what it writes later is a done byte); the host reports each part missing.
#
# When the runner ends, the keeper writes the done byte too (the run is over) and, without a
# namespace, stays alive until killed: it is a child subreaper, so what the module started
# stays in its tree even when the runner is gone. What that fallback cannot stop, where the
# module runs as the keeper's user (this process is not root, or UID_BASE is "-"): a module
# that kills the keeper (its pid is the runner's parent) and leaves a daemon with a session
# and a working directory of its own; the member list of the run's cgroups finds
# that one where one could be made (code_repair_limits), else the container's kill takes it;
# and a module that signals its process group (kill(0), killpg(getpgid(0))), which is the env
# server's: it kills the server. The fallback keeps the run in that group all the same (no
# session of the keeper's own, with kill_left_in scanning the keeper's group instead): the
# group is how a container's kill reaches what the module started when the server dies
# mid-run: the keeper and the runner die with their parents (PR_SET_PDEATHSIG), the module's
# children have no such signal, and the process runtime kills a container by its process
# group (in a session of the keeper's, they would live on, reparented, until a later run's
# sweep of dead servers' cgroups, or for good where no cgroup could be made). Where the
# module runs as a uid of its own (a root server, UID_BASE) its signals reach no process of
# the server's. A module that writes DONE_FD early only cuts its own results short.
RUNNER = r"""
import ctypes, os, select, signal, sys
parent, done_fd, isolate = int(sys.argv[1]), int(sys.argv[3]), sys.argv[4] == "1"
shm_bytes = int(sys.argv[5])
run_uid = None if sys.argv[6] == "-" else int(sys.argv[6]) + os.getpid()  # (the keeper's pid)
try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except Exception:
    libc = None  # not Linux: the timeout and the CPU limit still apply
if os.getppid() != parent:  # its parent died before prctl took effect
    os._exit(1)
spec_line = sys.stdin.readline()
# the waits below hold the spec's pipe on an fd of their own; the module's stdin is empty, as
# the pipe was once its parent closed it after the spec
stdin_fd = os.dup(0)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)

def unshare_pid():
    # a PID namespace (CLONE_NEWPID), and a mount namespace (CLONE_NEWNS) where it can be had
    # too, for the run's own /dev/shm and /proc, and a network namespace (CLONE_NEWNET, asked
    # apart: either may be refused alone): whether each was made
    if libc is None or not isolate:
        return False, False, False
    for flags in (0x20000000 | 0x20000, 0x20000000):
        if libc.unshare(flags) == 0:
            return True, bool(flags & 0x20000), unshare_net()
    if run_uid is not None:  # a user namespace would map root alone: the run's uid not in it
        return False, False, False
    uid, gid = os.getuid(), os.getgid()  # the new user namespace maps only these, to themselves
    for flags in (0x10000000 | 0x20000000 | 0x20000, 0x10000000 | 0x20000000):  # and CLONE_NEWUSER
        if libc.unshare(flags) == 0:  # (which needs no capability)
            break
    else:
        return False, False, False
    for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            pass  # unmapped, the ids read as the overflow id inside; files are still its own
    return True, bool(flags & 0x20000), unshare_net()  # (its capabilities there make the netns)

def unshare_net():
    # a network namespace of the run's own: no interface but a loopback that is down, so the
    # module reaches no localhost service (the env server's own TCP port, in a container with
    # a network of its own), no other host and no abstract Unix socket (those are the network
    # namespace's); a Unix socket with a path is a file, reached as its permissions allow.
    # Whether it was made
    return libc.unshare(0x40000000) == 0

def private_mounts():
    # MS_REC | MS_PRIVATE: what is mounted from here on stays in the run's mount namespace
    return libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0

def own_shm():
    # a tmpfs of the run's own on /dev/shm, in its own mount namespace (never the
    # container's): freed when the run's last process ends, with what the run wrote there
    # (charged to its memory cgroup), which the next run never sees. Whether it was made
    opts = f"mode=1777,size={shm_bytes}".encode()
    return (
        os.path.isdir("/dev/shm")
        and private_mounts()
        and libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0x2 | 0x4, opts) == 0
    )

def own_proc():
    # a proc of the run's PID namespace on /proc (made by a process in it: the init), in the
    # run's mount namespace: it lists the run's processes alone, never the container's
    # command lines. MS_NOSUID | MS_NODEV | MS_NOEXEC. Whether it was made
    if not (private_mounts() and libc.mount(b"proc", b"/proc", b"proc", 0x2 | 0x4 | 0x8, None) == 0):
        return False
    # read-only where a module run as uid 0 writes as the files' owner, capabilities or none (a
    # sysctl: the host's core_pattern, the container's hostname; the sysrq trigger), as Docker
    # makes them in a container's /proc, which this fresh proc covers. MS_BIND, then that bind
    # remounted MS_RDONLY (its other flags kept). Where refused, the container's /proc again
    for path in (b"/proc/sys", b"/proc/sysrq-trigger", b"/proc/irq", b"/proc/bus", b"/proc/fs"):
        if os.path.exists(path) and not (
            libc.mount(path, path, None, 0x1000, None) == 0
            and libc.mount(None, path, None, 0x1000 | 0x20 | 0x1 | 0x2 | 0x4 | 0x8, None) == 0
        ):
            libc.umount2(b"/proc", 2)  # MNT_DETACH: with the binds made so far
            return False
    return True

isolated, own_mounts, own_net = unshare_pid()
shm_own = own_mounts and own_shm()
proc_own = False
if libc is not None:
    libc.prctl(1, 9)  # again: a change of credentials may clear it
    libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the run stay in its tree
if os.getppid() != parent:
    os._exit(1)
alive_r, alive_w = os.pipe()
child = os.fork()
if child:  # the keeper
    os.close(alive_r)
    while True:
        try:
            os.waitpid(child, 0)
        except ChildProcessError:
            break
        except OSError:
            continue
        break
    try:
        os.write(done_fd, b"D")
        if not isolated:  # what the run started is in the keeper's tree until its parent kills it
            os.read(stdin_fd, 1)
    except OSError:
        pass  # the parent gone or the pipe closed: exit all the same
    os._exit(0)
os.close(alive_w)
if libc is not None:
    libc.prctl(1, 9)  # with the keeper (a fork clears it)
if select.select([alive_r], [], [], 0)[0]:  # the keeper died before prctl took effect
    os._exit(1)
os.close(alive_r)
if isolated:
    # where refused, the run sees the container's /proc, as without a mount namespace
    proc_own = own_mounts and own_proc()
    runner = os.fork()
    if runner:  # pid 1 of the namespace: it reaps until the runner ends, then ends it all
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: nothing inside can signal it
        while True:
            try:
                if os.wait()[0] == runner:
                    break
            except ChildProcessError:
                break
            except OSError:
                pass  # EINTR and the like: wait again
        os._exit(0)
    if libc is not None:
        libc.prctl(1, 9)  # with the init
    # a session of the runner's own: the keeper and the init are in the env server's process
    # group, where the module, as the server's own user (or root), signalled the server
    # (kill(0), killpg of its own group). Here, not in the init: the init stays in the server's
    # group, so that a container's kill of that group reaches it (and its death ends the
    # namespace) without the keeper's death signal in between; and the module cannot name
    # that group (it has no id in this PID namespace: getpgid reads 0), nor signal the init
    # (it ignores what comes from inside). Nothing of the namespace outlives the init, so
    # kill_left_in need not find it by the server's group
    os.setsid()
import importlib, json, traceback
spec = json.loads(spec_line)
here = os.getcwd()

def through(moved, path):
    for old, new in moved.items():
        if path == old or path.startswith(old + "/"):
            return new + path[len(old):]
    return path

def open_to_all(path):
    # whether any user may list path and search every dir above it (the run's uid is none of
    # their owners and its group is its own: the bits for others are its), on its way as
    # written (a symlink in it under /root) and as resolved
    for p in {os.path.abspath(path), os.path.realpath(path)}:
        if not os.stat(p).st_mode & 0o004:
            return False
        while True:
            if not os.stat(p).st_mode & 0o001:
                return False
            if p == "/":
                break
            p = os.path.dirname(p)
    return True

def mount_library():
    # the interpreter's library may lie under a dir of root's alone (a pyenv under /root). An fd
    # to it, or its path through /proc/self/fd, would let the module climb by '..' to all that
    # dir holds below it (/root/.pyenv, a project's files beside its venv): each such dir is
    # bind-mounted instead, as root, on a dir of the run's own tmpfs (on /dev/shm, in its own
    # mount namespace), whose '..' leads only back into that tmpfs. Returns {old path: new}
    moved, mounts = {}, []
    for path in sys.path:
        try:
            if os.path.isdir(path) and not open_to_all(path):
                mounts.append(path)
        except (OSError, TypeError, ValueError):
            pass  # not a dir (a zip that is not there, a hook's name)
    if not mounts:
        return moved
    # (the fallback, or no CLONE_NEWNS with the PID namespace: one of the runner's own)
    if not shm_own and (libc is None or (not own_mounts and libc.unshare(0x20000) != 0) or not own_shm()):
        raise PermissionError(
            f"the interpreter's library ({mounts[0]}) is under a dir that only root may search, "
            "and no tmpfs of the run's own could be mounted to lend it to the run: install Python "
            "where every user may read it"
        )
    top = "/dev/shm/.envpool-lib"  # root's in a sticky dir: the module cannot move it
    os.mkdir(top, 0o755)
    for i, path in enumerate(mounts):
        target = f"{top}/{i}"
        os.mkdir(target, 0o755)
        if libc.mount(path.encode(), target.encode(), None, 0x1000, None) != 0:  # MS_BIND
            raise PermissionError(f"{path} could not be bind-mounted (errno {ctypes.get_errno()})")
        moved[path] = target
    return moved

def reach_library(moved):
    if moved:
        sys.path[:] = [through(moved, p) if type(p) is str else p for p in sys.path]
        for m in list(sys.modules.values()):  # the packages imported already: their submodules
            if type(getattr(m, "__path__", None)) is list:
                m.__path__[:] = [through(moved, p) for p in m.__path__]
        sys.path_importer_cache.clear()

def caps(data):
    # capget into data (6 u32: {effective, permitted, inheritable} for caps 0-31, then 32-63)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")

def holds_caps():
    # whether this process holds any capability (effective or permitted)
    if libc is None:
        return False  # not Linux: none
    data = (ctypes.c_uint32 * 6)()
    try:
        caps(data)
    except OSError:
        return True  # not known to hold none
    return any(data[i] for i in (0, 1, 3, 4))

def drop_caps():
    # every capability this process holds, gone for good (the comment above says why): none
    # effective, permitted, inheritable or ambient, no_new_privs (no exec gives one back), and
    # the bounding set emptied where CAP_SETPCAP allows (without it, nothing held to drop).
    # OSError where any is left
    before = (ctypes.c_uint32 * 6)()
    caps(before)
    setpcap = before[0] >> 8 & 1  # CAP_SETPCAP, effective: the bounding set may be cut
    cap = 0
    while cap < 64 and libc.prctl(23, cap, 0, 0, 0) >= 0:  # PR_CAPBSET_READ: up to the last cap
        if libc.prctl(24, cap, 0, 0, 0) != 0 and setpcap:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), f"capability {cap} stays in the bounding set")
        cap += 1
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL (none before 4.3; capset clears them too)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # effective, permitted, inheritable: none
        raise OSError(ctypes.get_errno(), "capset failed")
    after = (ctypes.c_uint32 * 6)()
    caps(after)
    if any(after):
        raise OSError(f"capabilities left: {list(after)}")
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(39, 0, 0, 0, 0) != 1:  # PR_SET/GET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "no_new_privs could not be set")

def refuse(key, why):
    # the runner's own line in place of the results, which the host reports: the module never runs
    with os.fdopen(int(sys.argv[2]), "w", encoding="utf-8") as f:
        f.write(json.dumps({key: why}) + "\n")
    os._exit(1)

ppid = os.getppid()
if run_uid is None:  # (a uid of the run's own drops them all below, by setresuid)
    try:
        if libc is not None:
            drop_caps()
        elif sys.platform.startswith("linux"):
            raise OSError("no libc to drop them with")
    except OSError as e:
        refuse("caps_error", str(e))
    if libc is not None:
        libc.prctl(1, 9)  # again: a change of credentials may clear it
    if os.getppid() != ppid:  # its parent died before prctl took effect
        os._exit(1)
else:
    try:
        moved = mount_library()
        os.setgroups([])
        os.setresgid(run_uid, run_uid, run_uid)
        os.setresuid(run_uid, run_uid, run_uid)
        if os.getresuid() != (run_uid,) * 3 or os.getresgid() != (run_uid,) * 3:
            raise PermissionError(f"the ids read {os.getresuid()} and {os.getresgid()}")
        try:
            os.setuid(0)
        except PermissionError:
            pass  # root is out of reach, as it should be
        else:
            raise PermissionError("root could be taken back")
        # no exec gives privileges back: a set-uid program in the container (su, mount,
        # passwd, one a package left) runs as the run's uid, never as its owner
        if libc is not None and (libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(39, 0, 0, 0, 0) != 1):
            raise PermissionError("no_new_privs could not be set")
    except OSError as e:
        refuse("uid_error", f"uid {run_uid}: {e}")
    if libc is not None:
        libc.prctl(1, 9)  # a change of credentials cleared it
        libc.prctl(4, 1)  # PR_SET_DUMPABLE, which it cleared too: /proc/self is the module's
    if os.getppid() != ppid:  # its parent died before prctl took effect
        os._exit(1)
    reach_library(moved)
    if not os.access(here, os.R_OK | os.X_OK):  # a dir above the work dir is root's alone
        here = "/proc/self/cwd"  # (reached through the process, not the path)
# the isolation the run got, for the host to report: the first byte on DONE_FD, its high bit
# set, written before the module runs (nothing of the module's can have written first; the
# host reads any later byte as a done byte). Bits: its PID, mount and network namespaces, its
# own /proc and /dev/shm, no capability held
flags = [isolated, own_mounts, own_net, proc_own, shm_own, not holds_caps()]
try:
    os.write(done_fd, bytes([0x80 | sum(1 << i for i, on in enumerate(flags) if on)]))
except OSError:
    os._exit(1)  # the parent gone: nothing to report to
# bound before the module runs: what it patches in os or sys cannot stop the end below
_write, _read, _exit, done_fd = os.write, os.read, os._exit, int(sys.argv[3])
results = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")

def send(obj):
    try:
        line = json.dumps(obj)
    except ValueError:  # an int past 4300 digits (Python's limit on int to str)
        line = json.dumps({"i": obj.get("i"), "too_large": -1})
    if len(line) > 100_000:
        line = json.dumps({"i": obj.get("i"), "too_large": len(line)})
    results.write(line + "\n")
    results.flush()

def text(f):
    try:
        return str(f())[:500]
    except BaseException:
        return "?"

def where(e):
    try:
        tb = traceback.extract_tb(e.__traceback__)
        return f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}: {tb[-1].line}" if tb else ""
    except BaseException:
        return ""

def mro(e):
    try:
        return [str(c.__name__) for c in type(e).__mro__]
    except BaseException:
        return ["?"]

def plain(x):
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t in (list, tuple):
        return [plain(v) for v in x]
    if t is dict and all(type(k) is str for k in x):
        return {k: plain(v) for k, v in x.items()}
    raise TypeError(t.__name__)

sys.path.insert(0, here)
try:
    module = importlib.import_module(spec["module"])
    names = {}
    for name in spec["imports"]:
        if not hasattr(module, name):
            raise ImportError(f"cannot import name {name!r} from {spec['module']!r}")
        names[name] = getattr(module, name)
except BaseException as e:
    send({"import_error": f"{mro(e)[0]}: {text(lambda: e)}", "at": where(e)})
else:
    for i, call in enumerate(spec["calls"]):
        try:
            value = eval(call, dict(names))
        except BaseException as e:
            send({"i": i, "raised": mro(e), "message": text(lambda: e), "at": where(e)})
            continue
        try:
            out = plain(value)
        except BaseException:  # not a plain value, or nested too deep
            send({"i": i, "not_plain": type(value).__name__, "repr": text(lambda: repr(value))[:200]})
        else:
            send({"i": i, "value": out})
try:
    results.close()
    _write(done_fd, b"D")
    _read(stdin_fd, 1)  # the parent kills this process and its tree, or closes stdin
except BaseException:
    pass  # the module broke these fds: the parent sees the exit, and sweeps the work dir
_exit(0)
"""
