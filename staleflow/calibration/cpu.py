"""``CpuMeter``: CPU time used on this machine by processes outside our own process tree, read from
Linux ``/proc``, so wall-clock profiling can tell a quiet machine from a busy one."""

from __future__ import annotations

import os


class CpuMeter:
    """CPU time used on this machine by processes outside our own process tree (Linux ``/proc``).

    Wall-clock timings are only as good as the machine is quiet: on a shared host another job
    inflates the step latency we measure. ``foreign_seconds()`` is a counter of busy CPU seconds
    (steal time included) minus those of this process and its descendants (vLLM's engine core and
    workers); its rate over an interval says how many cores others used meanwhile.
    """

    def __init__(self, root: int | None = None):
        self.root = root or os.getpid()
        self.hz = os.sysconf("SC_CLK_TCK")

    @classmethod
    def create(cls) -> CpuMeter | None:
        """A meter, or None where ``/proc`` is not readable (not Linux)."""
        meter = cls()
        try:
            meter.foreign_seconds()
        except (OSError, ValueError, IndexError):
            return None
        return meter

    def foreign_seconds(self) -> float:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
        busy = cpu[0] + cpu[1] + cpu[2] + sum(cpu[5:8])  # user nice system (idle iowait) irq softirq steal
        return (busy - self._tree_ticks()) / self.hz

    def engine_wait_seconds(self) -> float | None:
        """Seconds the engine's stepping thread has spent runnable but not running (``schedstat``).

        That thread is the main thread of the descendant process named ``VLLM::EngineCore`` (vLLM's
        engine core, which runs the step loop). Subtracted from an interval's wall time it removes the
        time other processes held the CPU the engine wanted; None where it cannot be read.
        """
        pid = self._engine_pid
        if pid is None:
            pid = self._engine_pid = self._find_engine()
            if pid is None:
                return None
        try:
            with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            self._engine_pid = None  # exited (restarted engine): look again next time
            return None

    _engine_pid: int | None = None

    def _find_engine(self) -> int | None:
        procs = _processes()
        parents = {pid: parent for pid, parent, _, _ in procs}
        for pid, _, comm, _ in procs:
            if comm.startswith("VLLM::EngineCor") and self._in_tree(pid, parents):
                return pid
        return None

    def _in_tree(self, pid: int, parents: dict[int, int]) -> bool:
        p, hops = pid, 0
        while p > 1 and p != self.root and hops < 64:
            p, hops = parents.get(p, 0), hops + 1
        return p == self.root

    def _tree_ticks(self) -> int:
        procs = _processes()
        parents = {pid: parent for pid, parent, _, _ in procs}
        return sum(ticks for pid, _, _, ticks in procs if self._in_tree(pid, parents))


def _processes() -> list[tuple[int, int, str, int]]:
    """(pid, parent pid, name, utime + stime ticks) of every process in ``/proc``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue  # exited meanwhile
        fields = rest.split()
        found.append((int(entry.name), int(fields[1]), head.split("(", 1)[1], int(fields[11]) + int(fields[12])))
    return found
