"""Heartbeats between a run's trainer ranks, so that a rank killed or frozen mid-step is named within a bound,
not waited out in a collective (gloo's wait is the strategy's `collective_timeout_s`, NCCL's alike).

Why a process of its own (a sentinel per rank, `python -m rlvr_lightning.callbacks.rank_watch`): a rank waiting
in a collective holds the interpreter lock inside PyTorch's `Work.wait`, so no thread of the trainer runs until
the collective ends; a healthy rank waiting for a slow one would look frozen, and could not act anyway.

Each sentinel, every `interval_s`: if its rank's process is alive and not stopped (its state in /proc), it adds
one to its rank's counter in the run's rendezvous store (the TCPStore rank 0 hosts at MASTER_ADDR:MASTER_PORT),
over a connection of its own with a short timeout; it reads the other ranks' counters. A rank whose counter has
not moved for `unresponsive_s` (or that never beat within `SENTINEL_START_S`), or a store that has not answered for
that long (it lives in rank 0's process), is lost: the sentinel writes one line naming the rank to its trainer's
stderr and stops its trainer (SIGTERM, then SIGKILL after `KILL_GRACE_S`: a collective's wait ignores the
first). Counters, not clocks: the ranks' clocks need not agree. Linux only (/proc); elsewhere nothing watches."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from rlvr_lightning.errors import RESUME_HINT

KILL_GRACE_S = 5.0


ENDED_NORMALLY, ENDED_BY_ERROR = 1, 2  # a rank's `ended` counter: its training ended, or stopped on an error


LOST_KEY = "rlvr/lost"  # 1 + the rank the first sentinel to notice took for lost


def heartbeat_key(rank: int) -> str:
    return f"rlvr/heartbeat/{rank}"


def ended_key(rank: int) -> str:
    return f"rlvr/ended/{rank}"


def mark_ended(rank: int, how: int) -> None:
    """Tell the other ranks' sentinels that this rank's training ended (`ENDED_NORMALLY`: not lost when its
    heartbeat stops) or stopped on an error (`ENDED_BY_ERROR`: they stop theirs rather than wait in a collective)."""
    import torch.distributed as dist

    try:
        dist.distributed_c10d._get_default_store().add(ended_key(rank), how)
    except Exception:  # no process group, or its store is gone: the heartbeats tell the rest
        pass


def store_client(timeout_s: float):
    """A connection of its own to the run's rendezvous store (MASTER_ADDR:MASTER_PORT), each call bounded by
    `timeout_s`."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def silent_peer(rank: int, world_size: int, interval_s: float) -> int | None:
    """The first other rank whose heartbeat does not move over 1.5 of its sentinel's intervals (rank 0 when its
    store does not answer), else None: which rank a collective that just failed lost. Short: Lightning's observer
    of the ranks it launched kills the run within 5 s of a rank's death."""
    try:
        store = store_client(5.0)
        peers = [r for r in range(world_size) if r != rank]
        before = {r: store.add(heartbeat_key(r), 0) for r in peers}
        time.sleep(1.5 * interval_s)
        moved = {r: store.add(heartbeat_key(r), 0) != before[r] for r in peers}
    except Exception:
        return 0 if rank != 0 else None
    return next((r for r in peers if not moved[r]), None)


def lost_rank_line(rank: int, lost: int, unresponsive_s: float, why: str) -> str:
    return f"error: [rank {rank}] rank {lost} {why} (watchdog.rank_unresponsive_s = {unresponsive_s:g}). {RESUME_HINT}"


def heartbeat_interval_s(unresponsive_s: float) -> float:
    return min(2.0, unresponsive_s / 5)


SENTINEL_START_S = 120.0  # a sentinel's start (an interpreter importing PyTorch) and the ranks' skew in starting theirs


def start_sentinel(rank: int, world_size: int, unresponsive_s: float) -> subprocess.Popen | None:
    """This rank's sentinel, once it has sent its first heartbeat (None where /proc is missing, or when it did not
    come up within `SENTINEL_START_S`); it ends by itself when this process ends. Waiting for it means a rank
    frozen at any point of training is seen: one frozen before its sentinel's first beat would only be seen after
    the bound for a rank that never beat."""
    import select

    if not Path("/proc/self/stat").exists() or "MASTER_PORT" not in os.environ:
        return None
    args = [sys.executable, "-m", "rlvr_lightning.callbacks.rank_watch", "--pid", str(os.getpid()),
            "--rank", str(rank), "--world-size", str(world_size), "--unresponsive-s", str(unresponsive_s)]  # fmt: skip
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
    if select.select([proc.stdout], [], [], SENTINEL_START_S)[0] and proc.stdout.readline().strip() == b"beating":
        return proc
    proc.kill()
    proc.wait()
    print(f"warning: rank {rank}'s sentinel did not start within {SENTINEL_START_S:g} s: a rank killed or frozen will "
          "be waited out in a collective (trainer.strategy.init_args.collective_timeout_s)", file=sys.stderr)  # fmt: skip
    return None


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, D, T for stopped, Z, …), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


class Sentinel:
    def __init__(self, pid: int, rank: int, world_size: int, unresponsive_s: float) -> None:
        self.pid, self.rank, self.world_size = pid, rank, world_size
        self.unresponsive_s, self.first_beat_s = unresponsive_s, max(SENTINEL_START_S, unresponsive_s)
        self.interval_s = heartbeat_interval_s(unresponsive_s)

    def run(self) -> None:
        store = store_client(max(1.0, self.unresponsive_s / 4))
        store.add(heartbeat_key(self.rank), 1)
        print("beating", flush=True)  # the trainer waits for this line (`start_sentinel`)
        sys.stdout.close()
        start = time.monotonic()
        seen = dict.fromkeys(range(self.world_size), (0, start))  # rank -> (its counter, when it last moved)
        store_ok, ended = start, {}
        peers = [r for r in range(self.world_size) if r != self.rank]
        while True:
            time.sleep(self.interval_s)
            state, now = process_state(self.pid), time.monotonic()
            if state in (None, "Z", "X"):
                return  # the trainer ended: nothing to watch
            try:
                if state not in ("T", "t"):  # a stopped trainer sends no heartbeat: that is how others see it
                    store.add(heartbeat_key(self.rank), 1)
                counts = {r: store.add(heartbeat_key(r), 0) for r in peers}
                ended = {r: store.add(ended_key(r), 0) for r in peers}
                taken_for_lost = store.add(LOST_KEY, 0) - 1
                store_ok = now
            except Exception as err:  # no answer within the timeout, or refused: rank 0's process
                if ended.get(0) == ENDED_NORMALLY:
                    return  # rank 0 finished and took its store with it
                if self.rank != 0 and now - store_ok > self.unresponsive_s:
                    where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
                    self.lost(0, now - store_ok, f"its rendezvous store at {where} did not answer: {err}")
                    return
                continue
            if taken_for_lost == self.rank:  # frozen, say: another rank's sentinel stopped the run over it
                self.stop_trainer(f"error: [rank {self.rank}] the other ranks took this rank for lost and stopped; "
                                  "stopping it too")  # fmt: skip
                return
            if failed := [r for r in peers if ended[r] >= ENDED_BY_ERROR]:
                self.lost(failed[0], 0, "it stopped on an error: its own log says which")
                return
            for r, count in counts.items():
                if ended[r] == ENDED_NORMALLY:
                    continue
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > (self.unresponsive_s if count > 0 else self.first_beat_s):
                    try:  # the lost rank's own sentinel, if it runs, stops it rather than report the others
                        store.add(LOST_KEY, r + 1)
                    except Exception:
                        pass
                    self.lost(r, now - seen[r][1], "no heartbeat" if count > 0 else "no heartbeat yet")
                    return

    def lost(self, rank: int, silent_s: float, what: str) -> None:
        why = f"stopped answering: no sign of it for {silent_s:.0f} s ({what}): it was killed, froze or lost its machine"
        self.stop_trainer(lost_rank_line(self.rank, rank, self.unresponsive_s, why if silent_s else what))

    def stop_trainer(self, line: str) -> None:
        """Say `line` on the trainer's stderr, then stop the trainer: SIGTERM, SIGKILL if it is still there."""
        print(line, file=sys.stderr, flush=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + KILL_GRACE_S
            while process_state(self.pid) not in (None, "Z") and time.monotonic() < deadline:
                time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description="A trainer rank's sentinel (see the module docstring).")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--unresponsive-s", type=float, required=True)
    a = parser.parse_args()
    Sentinel(a.pid, a.rank, a.world_size, a.unresponsive_s).run()


if __name__ == "__main__":
    main()
