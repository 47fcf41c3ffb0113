"""Checkpoint and stop cleanly when Slurm is about to end the job.

A signal handler may run at any point of a step, also inside a collective, so it only sets a flag; at the end of each
optimizer step all ranks agree (one all-reduce) whether any was asked to stop, then every rank saves and leaves the
loop at the same step. A batch script's pre-timeout signal (`--signal=B:USR1@...`) reaches the batch shell only, so
there are two ways to ask:
- SIGUSR1, SIGTERM (preemption, `scancel`), SIGINT (Ctrl-C; a second one stops at once) or SIGHUP (the terminal
  closed: what went to it goes to /dev/null from then on; terminal.py) delivered to a training process;
- the launcher that started the process gone (`kill -9` of `accelerate launch` in a terminal): the ranks were left
  running as orphans, holding the run's lock, writing checkpoints and the GPUs, with nothing left to stop them. The
  kernel tells each rank (PR_SET_PDEATHSIG, `LAUNCHER_GONE`), which stops as on a request (under Slurm the step's
  cgroup kills them anyway);
- a stop file: the batch script's trap creates `$DPOTRAIN_STOP_FILE` (on a file system all nodes share).
Once progress is on disk the main process writes `<stop file>.checkpointed`, which tells the batch script to requeue
the job, and the process exits with STOPPED_EXIT. Its second line, NOTHING_SAVED, says that this start saved nothing
a requeue would not do again (no checkpoint, no reference pairs): a time-limit warning that stopped it would stop every
requeue as early (scripts/launch.sh, dpotrain/cluster/job.py: check_warned_start).
"""

import ctypes
import errno
import functools
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from transformers import TrainerCallback

from dpotrain.cluster import run_lock
from dpotrain.cluster.collectives import main_outcome, max_of_ranks, max_over_ranks
from dpotrain.recipe import launcher, terminal
from dpotrain.recipe.cli import FALSE, TRUE
from dpotrain.recipe.config import without_secrets
from dpotrain.recipe.errors import ConfigError, RunError, cause, first_to_say, mark_one_line_ends, warn
from dpotrain.recipe.writes import unwritable, write_text
from dpotrain.train import step_log

STOP_FILE_ENV = "DPOTRAIN_STOP_FILE"
STOP_SIGNALS = terminal.STOP_SIGNALS
# A run that saved and stopped before its end exits with this code (EX_TEMPFAIL of sysexits.h: try again later): the
# same command goes on from what was saved. A second Ctrl-C ends the process at once with 130 (128 + SIGINT).
STOPPED_EXIT = 75
INTERRUPTED_EXIT = 130
SECOND_CTRL_C_S = 1.0
# The signal the kernel sends a launched rank when its launcher (its parent) dies: PR_SET_PDEATHSIG, Linux's prctl
LAUNCHER_GONE = signal.SIGUSR2
ACCELERATE_LAUNCH = "accelerate-launch"  # accelerate's console script of `accelerate launch`
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2
# The requests that end the job: Slurm's time limit or preemption, `scancel`, a `kill`, the launcher gone, and a stop
# file made since the start (launch.sh's trap). A person's first Ctrl-C asks for the run's outputs to be finished, a
# closed terminal's SIGHUP for the run to go on as under nohup: neither ends the job, but one of these after them does.
ENDS_JOB = (signal.SIGTERM, signal.SIGUSR1, LAUNCHER_GONE)
NEW_STOP_FILE, OLD_STOP_FILE = "stop file", "stop file found at start"
# What scripts/launch.sh's trap writes in the stop file (`SIGUSR1`, `SIGTERM`). It removes its stop file as each start
# begins, so one that holds this was asked in this start, though made before a rank first looked (its imports take
# seconds): a request, not a file left from before the start.
SIGNALLED = b"SIG"
NOTHING_SAVED = "nothing saved"  # `.checkpointed`'s second line: this start saved nothing a requeue would not redo
# A look at the stop file that got no answer (NFS: ESTALE, EIO): not "none there", which a file left from an earlier
# attempt would then be taken for at the start, and read as a new request at the next look
UNREAD = ("unread",)


class StoppedBeforeTraining(Exception):
    """Raised out of `trainer.train` on every rank by `GracefulStop.on_step_begin` (the stop agreed on and reported):
    nothing is trained or saved, and the Trainer has no other way to leave before a step (`should_training_stop` is
    read once the step is over)."""


class GracefulStop(TrainerCallback):
    def __init__(self, stop_file: str | None = None, command: list[str] | None = None):
        self.stop_file = Path(stop_file) if stop_file else None
        # The process whose stop this is: a process forked from it (datasets' `map(num_proc=N)` workers) keeps its
        # handlers, and answered a terminal's Ctrl-C too (a line each, `os._exit` on the second): `_on_signal`.
        self.pid = os.getpid()
        self.unread = ""  # why the last look at the stop file got no answer (UNREAD)
        # Each request heard (a signal's number, NEW_STOP_FILE or OLD_STOP_FILE), in the order first heard, with when
        # this process heard it (time.time()): the strongest decides (`asked_to_end`), not the first. A list: a signal
        # handler appends while the main thread reads it. A stop file's time is when this process first saw it, by its
        # own clock, never its mtime: on NFS the file server stamps that, and a server clock an hour behind made a stop
        # of seconds "3600 s after the request". Seen only where it is looked for (a step's end, a stage boundary), so
        # the stop line says "after the stop file was seen", not "after the request".
        self.heard: list[tuple[int | str, float]] = []
        # The stop file as it was when this process started (None: not there): that one was not asked as it ran
        # (stop_before_training). Compared by identity, not its mtime against this host's clock: on NFS the file
        # server stamps the mtime, and a server clock behind the node's hid a request made in its lag, one ahead made
        # a file left from before the start a new request. UNREAD (the look got no answer): the first answer before
        # training begins is taken as the start's (`_stop_file_asks`); a file first seen after it, as a request.
        self.found_at_start = self._stop_file_identity()
        if self.found_at_start is UNREAD:
            self._say_unread_at_start()
        elif self.found_at_start is not None and self._signalled():
            self.found_at_start = None  # launch.sh's request of this start: a time-limit warning, answered at once
        self.started_at = time.time()  # when a stop file found at the start was seen
        self.stopped = False
        # Saved in this start what a requeue goes on from (a checkpoint, reference pairs scored), not to do it again;
        # a stop without it writes NOTHING_SAVED (mark_saved). Set by on_save, the reference stage, the final push.
        self.saved = False
        self.interrupted: float | None = None  # when a first Ctrl-C was pressed (time.monotonic())
        terminal.run_begins()  # a Ctrl-C heard is this run's: one before it was a run's before it in this process
        self.training_over = False  # no step left to stop at: the final model and the run's outputs are being saved
        self.pushing_only = False  # a rerun that trains nothing, completing a push (`nothing_to_train`)
        self.ending_only = False  # one that pushes nothing either: offline, its push left for push_to_hub.py
        self.training_begun = False  # a step to stop at: before it, the run stops at the next stage boundary
        self.recipe_resumes = False  # the recipe file names a resume_from_checkpoint, which the printed command clears
        self.reference_only = False  # --reference_only: no step to stop before, its reference stage (`take_recipe`)
        # the run's command where it is not this process's own (`train_dpo.main(argv)`, called by another program)
        self.command = command
        self.terminal = [fd for fd in terminal.STREAMS if os.isatty(fd)]  # what a SIGHUP closes
        self.launcher_pid: int | None = None  # the launcher whose death stops this rank (`_watch_launcher`)
        self.previous = {}  # the handlers found, given back to a caller that goes on after the run (release)
        if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
            for sig in STOP_SIGNALS:
                # `nohup` ignores SIGHUP so that the run outlives its terminal, and a script's background job (`python
                # train_dpo.py ... &` without job control) starts with SIGINT ignored so that the Ctrl-C meant for the
                # script's foreground command spares it: those stay ignored. The others are taken over ignored too:
                # scripts/launch.sh's srun shell ignores TERM for torchrun's agent.
                if sig in (signal.SIGHUP, signal.SIGINT) and signal.getsignal(sig) == signal.SIG_IGN:
                    continue
                # One heard while the libraries loaded (terminal.hold_stops) is heard now, when it was sent
                self.previous[sig], held = terminal.take_held(sig, signal.signal(sig, self._on_signal))
                for signum, at in held:
                    self._hear(signum, at)
            self.launcher_pid = self._watch_launcher()
            _watch_forks()

    def _say_unread_at_start(self) -> None:
        """The start's look at the stop file got no answer: one line per node, by the first of its processes whose look
        failed (`errors.first_to_say`: the ranks have not met, so no collective can ask). Said by LOCAL_RANK 0 alone, a
        node whose LOCAL_RANK 0 had its answer, and another rank none (ESTALE is a moment's), said nothing, and that
        rank took the stop file as the start's where its node's first rank took it as a request. Without torchrun's
        folder to mark (another launcher), each process whose look failed says it: a line twice, not none."""
        line = (
            f"the stop file {self.stop_file} could not be looked at as the run started ({self.unread}): a stop "
            "file seen there before training begins is taken as there from the start (a stop after step 1, with "
            "its checkpoint), one first seen after it as a request made since"
        )
        if first_to_say(f"warning: {line}") is not False:
            warn(line)

    def _watch_launcher(self) -> int | None:
        """A rank a launcher started asks the kernel for `LAUNCHER_GONE` when the launcher dies; its pid, or None: no
        launcher, not Linux, or a death signal its starter chose already (a test harness's), which is kept."""
        if sys.platform != "linux":
            return None
        if not (launcher.under_launcher() or started_by_accelerate()):
            if orphaned_at_start():
                self._gone_before_start(None)
            return None
        libc, held = ctypes.CDLL(None, use_errno=True), ctypes.c_int(0)
        if libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(held)) != 0 or held.value:
            return None
        # The launcher as this process began (terminal.hold_stops): one killed while the libraries loaded left the
        # ranks orphans, which found their parent in init, asked nothing, and waited in silence, for good, for the
        # rendezvous its store held
        parent = terminal.parent_at_start() or os.getppid()
        launcher_command()  # while it is there: the command a stop prints to go on
        self.previous[LAUNCHER_GONE] = signal.signal(LAUNCHER_GONE, self._on_launcher_gone)
        libc.prctl(PR_SET_PDEATHSIG, int(LAUNCHER_GONE))
        if os.getppid() != parent:  # it died before the kernel was asked: nothing is started yet, nor can be
            self._gone_before_start(parent)
        return parent

    @staticmethod
    def _gone_before_start(parent: int | None) -> None:
        """The launcher died before this process asked the kernel to be told (its pid, where it was read): one line by
        the node's first process, and the run ends as stopped (nothing was started)."""
        if launcher.first_on_node():
            which = f"pid {parent}" if parent else "accelerate launch"
            terminal.say(
                2,
                f"The launcher ({which}) that started this run's processes is gone (killed?) before they started the "
                "run: nothing was started; the same command starts it\n".encode(),
            )
        raise SystemExit(STOPPED_EXIT)

    def _on_launcher_gone(self, signum, frame):
        """The launcher died (the kernel's signal: this process's parent changed): a stop request, said in one line by
        each node's first rank. A stray SIGUSR2, with the launcher still there, changes nothing; nor does the end of
        accelerate's simple launcher after a Ctrl-C or a closed terminal's SIGHUP, which it always ends on."""
        if self.launcher_pid is None or os.getppid() == self.launcher_pid:
            return
        hung_up = any(heard == signal.SIGHUP for heard, _ in self.heard)
        if (self.interrupted or hung_up) and simple_launch():
            # accelerate's simple launcher gets the terminal's Ctrl-C too and ends on it 0.25 s later (Popen.wait's
            # grace), every time, and on its SIGHUP at once: its end asks nothing the signal did not (a final push the
            # Ctrl-C said it finishes, one a closed terminal leaves to go on), but the terminal's next Ctrl-C reaches
            # the shell, not this process. (A closed terminal: no line, nothing reads it.)
            if not hung_up:
                pid = os.getpid()
                terminal.say(
                    2,
                    f"\naccelerate launch ended on that Ctrl-C, as it does, and gave the prompt back: this process "
                    f"(pid {pid}) goes on alone as the Ctrl-C said; `kill -INT {pid}` stops it at once\n".encode(),
                )
            return
        if not self.heard_to_end() and launcher.first_on_node():
            now = (
                b"ending"
                if self.ending_only
                else b"giving up the push to the Hub, then ending"
                if self.pushing_only
                else b"finishing the final model and the run's outputs, then ending"
                if self.training_over and not self.stopped
                else b"saving a checkpoint at the end of this step, then stopping"
                if self.training_begun
                else b"stopping before training, at the next safe point"
            )
            pid = str(self.launcher_pid).encode()
            terminal.say(
                2,
                b"\nThe launcher (pid " + pid + b") that started this run's processes is gone (killed?), and "
                b"nothing would stop them: " + now + b"; the same command goes on from what is saved\n",
            )
        self._hear(signum, time.time())

    def _hear(self, request: int | str, at: float) -> None:
        if request not in [heard for heard, _ in self.heard]:
            self.heard.append((request, at))

    @property
    def signal_received(self) -> int | None:
        """The first signal heard; None: none."""
        return next((heard for heard, _ in self.heard if isinstance(heard, int)), None)

    def heard_to_end(self) -> bool:
        """Whether a signal that ends the job (`ENDS_JOB`) was heard, whatever came before it."""
        return any(heard in ENDS_JOB for heard, _ in self.heard)

    @classmethod
    def from_env(cls, command: list[str] | None = None) -> "GracefulStop":
        stop_file = os.environ.get(STOP_FILE_ENV) or None
        if stop_file:
            check_stop_file(Path(stop_file))
        # A launched process's refusal (one `error:` line) is told to scripts/launch.sh, whose last line points at it
        mark_one_line_ends(f"{stop_file}.refused" if stop_file and launcher.under_launcher() else None)
        return cls(stop_file, command)

    def take_recipe(self, recipe) -> None:
        """The command a stop prints drops the command line's --resume_from_checkpoint; a recipe file's it clears; a
        --reference_only run's stop before its stage says so, not "before step 1" (it trains none). The
        stop is made before the recipe is parsed (a signal while it loads is kept), so the recipe comes here after. Read
        as parsed: the file read again refused, on a login node, the env: values its dry run leaves to the job."""
        self.recipe_resumes = recipe.recipe_resumes
        self.reference_only = recipe.project.reference_only

    def _on_signal(self, signum, frame):
        if os.getpid() != self.pid:  # a forked worker: the run's process answers the request (its workers end with it)
            if signum == signal.SIGHUP and self.terminal:
                terminal.detach(self.terminal)  # as the run's: a write to the closed terminal must not end the worker
            return
        # Nothing else: we may be in the middle of a collective. A second signal changes nothing (on a preemption srun
        # forwards SIGTERM again; dying then would lose the checkpoint being written), but a second Ctrl-C a person
        # pressed ends the process at once (terminal.say, an os.write: print is not safe inside a signal handler).
        if signum == signal.SIGINT:
            # Under `accelerate launch` Ctrl-C reaches the workers twice within milliseconds (directly, and forwarded
            # by torchrun's agent): only one pressed later counts as the second.
            if self.interrupted and time.monotonic() - self.interrupted > SECOND_CTRL_C_S:
                terminal.say(2, b"\nSecond Ctrl-C: stopping at once; nothing more is saved\n")
                # os._exit skips the run's own release: its lock, left, refused a rerun on another host for STALE_S
                run_lock.release()
                os._exit(INTERRUPTED_EXIT)
            if self.interrupted:
                return
            self.interrupted = time.monotonic()
            terminal.heard_ctrl_c()  # a `| tee` the same Ctrl-C killed: the lines below go on to the terminal
            # terminal.say: the `| tee` the same Ctrl-C killed may be gone already
            # The run saves its final model and outputs, and ends (0), once training is over
            terminal.say(
                2,
                b"\nCtrl-C: ending; nothing is trained or pushed here (HF_HUB_OFFLINE: push_to_hub.py pushes it)\n"
                if self.ending_only
                else b"\nCtrl-C: finishing the push to the Hub, then ending (Ctrl-C again: stop at once; the same "
                b"command completes it)\n"
                if self.pushing_only
                else b"\nCtrl-C: training is over; finishing the final model and the run's outputs, then ending "
                b"(Ctrl-C again: stop at once, without them)\n"
                if self.training_over and not self.stopped
                else b"\nCtrl-C: saving a checkpoint at the end of this step, then stopping (Ctrl-C again: stop "
                b"at once, without it)\n"
                if self.training_begun
                else b"\nCtrl-C: stopping before training, at the next safe point; what is saved is kept (Ctrl-C "
                b"again: stop at once)\n",
            )
        elif (
            self.training_over
            and not (self.stopped or self.pushing_only)
            and signum in ENDS_JOB
            and not self.heard_to_end()
        ):
            # (Pushing only, the push is given up at once, and its own line says so: "Stop requested: ...".)
            # No step left to stop at: the run goes on to its end. It said nothing, and a job killed at the end of
            # Slurm's KillWait stopped mid-save or mid-push in its log without a word; the rerun completes both. Said
            # after a first Ctrl-C or a SIGHUP too: this one ends the job (a final push is given up). (Not on SIGHUP
            # itself: its terminal is gone, and a write to it fails with EIO.)
            name = signal.Signals(signum).name.encode()
            terminal.say(
                2,
                b"\n" + name + b": training is over; finishing the final model and the run's outputs, then ending "
                b"(killed before they are done: the same command completes them)\n",
            )
        if signum == signal.SIGHUP and self.terminal:
            terminal.detach(self.terminal)
            self.terminal.clear()
        self._hear(signum, time.time())

    def nothing_to_train(self, pushing: bool = True) -> None:
        """A run that trains nothing (a rerun completing a finished run's push, `publish.complete_push`) hears a request
        as after training's last step: a first Ctrl-C finishes the push (it said "stopping before training" and the push
        went on), a SIGTERM or a stop file gives it up, and the stop line counts from the request that ended the job.
        Its lines speak of the push, not of a final model and outputs it does not make; not `pushing` (HF_HUB_OFFLINE:
        the push is left for push_to_hub.py), of neither: a Ctrl-C there said "finishing the push", which never
        began."""
        self.training_over = self.pushing_only = True
        self.ending_only = not pushing

    def release(self, exiting: bool) -> None:
        """The run is over. A process about to exit ignores stop signals from now on: a preemption's late SIGTERM
        must not kill it while Python shuts down (a FAILED job). A caller that goes on (`train_dpo.main` in a notebook)
        gets its handlers back: an ignored one stays so in every process it starts (a `| tee` Ctrl-C no longer ends)."""
        for sig, handler in self.previous.items():  # empty off the main thread, where none were set
            signal.signal(sig, signal.SIG_IGN if exiting or handler is None else handler)

    def not_needed(self) -> None:
        """The command saves nothing a stop could wait for (a dry run, a preflight): the handlers found are given back,
        so that Ctrl-C and SIGTERM end it at once. A stop asked already (while the options were read) ends it now."""
        self.release(exiting=False)
        if self.signal_received not in (None, signal.SIGINT):  # SIGTERM while the libraries loaded: as it ends any
            signal.raise_signal(self.signal_received)  # command (a handler given back, such as a caller's, answers it)
        if self.heard:
            raise KeyboardInterrupt

    def _stop_file_identity(self) -> tuple | None:
        """The stop file's device, inode, mtime (ns) and size; None: no stop file; UNREAD: a file system that did not
        answer (NFS: ESTALE), looked at again at the next check. Made again or touched: another."""
        if self.stop_file is None:
            return None
        try:
            found = self.stop_file.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            self.unread = cause(e, 120)
            return UNREAD
        return found.st_dev, found.st_ino, found.st_mtime_ns, found.st_size

    def _signalled(self) -> bool:
        """Whether the stop file is launch.sh's, written on a signal (`SIGNALLED`); unread, it is taken as one made by
        hand."""
        try:
            with open(self.stop_file, "rb") as f:
                return f.read(len(SIGNALLED)) == SIGNALLED
        except OSError:
            return False

    def asked_here(self, new_only: bool = False) -> bool:
        """A signal, or the stop file; `new_only`: not the one there at the start (`stop_before_training`)."""
        if self.signal_received is not None:
            return True
        return self._stop_file_asks(new_only)

    def _stop_file_asks(self, new_only: bool) -> bool:
        """Whether the stop file is there (`new_only`: made or touched since the start), noted as heard when first seen
        (one found at the start: seen then)."""
        found = self._stop_file_identity()
        if found is UNREAD:
            return False
        if self.found_at_start is UNREAD:  # no answer at the start: the first one before training is the start's
            # (an old file is not a new request); after training began, a file seen is taken as asked since, so that a
            # time limit's request while the look failed still ends the job (`asked_to_end`) instead of passing as old
            # A push-only rerun (`nothing_to_train`) never begins training: its push is where it could be stopped
            self.found_at_start = None if self.training_begun or self.pushing_only else found
        if found is None or (new_only and found == self.found_at_start):
            return False
        new = found != self.found_at_start
        self._hear(NEW_STOP_FILE if new else OLD_STOP_FILE, time.time() if new else self.started_at)
        return True

    def asked_to_end(self) -> bool:
        """Whether the job is to end (SIGTERM, SIGUSR1, the launcher gone, a stop file made since the start): what gives
        up a final push still running. Not a person's first Ctrl-C, told that the run finishes its outputs (a second
        one ends it at once), nor a closed terminal's SIGHUP, after which the run goes on as under nohup; but one that
        ends it, heard after them, does as alone (a run in a terminal or `srun` by hand, then Slurm's time limit)."""
        # A stop file seen once stays asked: removed before the final push asked again, the push completed and the run
        # exited 0, unrequeued, while the checkpoint uploads given up on it waited for the requeue
        seen = any(heard == NEW_STOP_FILE for heard, _ in self.heard)
        return self.heard_to_end() or seen or self._stop_file_asks(new_only=True)

    def stop_before_training(self, device, what: str, as_typed: bool = False) -> bool:
        """A stage boundary before training (the model about to load, step 1 about to start), where every rank calls
        it alike: one all-reduce, so that a request heard on any rank ends every rank here (none leaves a collective
        the others enter). Without it a request made while the data was read or the old run's files removed was
        honoured only at the end of step 1, after the model loaded and step 1 trained and saved. A stop file there
        before this process started, untouched since (scripts/launch.sh removes its own at the start, so one made by
        hand, or a test's; one launch.sh wrote on a signal, `SIGNALLED`, is this start's request), keeps its meaning:
        stop after step 1, with its checkpoint, which the tests use for a checkpoint-1 however fast the machine is.
        `as_typed`: nothing done yet that the command would redo (the old run not yet replaced), so the command printed
        to go on is the one typed (`rerun_command`)."""
        if not max_over_ranks(int(self.asked_here(new_only=True)), device):
            return False
        self.stopped = True
        main_outcome(self.mark_saved, what, as_typed)  # every rank: the main's refusal (a full disk) is every rank's
        return True

    def saved_something(self) -> None:
        """This start saved what a requeue goes on from (reference pairs scored, a complete run to push): its stop
        writes no NOTHING_SAVED line (`mark_saved`)."""
        self.saved = True

    def mark_saved(self, what: str, as_typed: bool = False, kept: str | None = None) -> None:
        """Main process, once progress is on disk: `<stop file>.checkpointed` tells the batch script to requeue the job;
        without a stop file, the line names the command to type again (`as_typed`: as it was typed). `kept`: the
        marker's first line (what was saved) where the stop line's `what` leaves it to a stage's own line just above
        (the reference stage's: the stop line repeated it whole)."""
        after = self._how_long()
        # Typed in another folder and run here (scripts/demo.sh runs in the project): its relative paths are that
        # folder's (DPOTRAIN_SUBMIT_DIR), so the command typed back here says so, or its --output_dir is another one
        # (the shell's $PWD names it by its links, os.getcwd() by where they lead: one folder is not two)
        typed_in = os.environ.get("DPOTRAIN_SUBMIT_DIR")
        elsewhere = typed_in and os.path.realpath(typed_in) != os.path.realpath(os.getcwd())
        told = f"DPOTRAIN_SUBMIT_DIR={shlex.quote(typed_in)} " if elsewhere else ""
        how = (
            "exiting so that the job can be requeued"
            if self.stop_file
            else (
                f"to go on from it, run the same command again, in {os.getcwd()}: "
                f"{told}{rerun_command(self.recipe_resumes, self.command, as_typed)}"
            )
        )
        step_log.write_line(f"Stop requested: {what}{after}; {how}")  # above the step's progress bar, not glued to it
        if self.stop_file:  # a refusal names the file
            write_text(
                f"{self.stop_file}.checkpointed", f"{kept or what}\n" + ("" if self.saved else f"{NOTHING_SAVED}\n")
            )

    def _how_long(self) -> str:
        """How long after the request it answers this stop comes, by this process's clock ("": it heard none, another
        rank did). Training over without a stop, the only stop left is a final push given up: it answers the first
        request that ends the job, not a first Ctrl-C or SIGHUP heard before it; any other answers the first request."""
        ending = self.training_over and not self.stopped
        request = next(
            ((heard, at) for heard, at in self.heard if not ending or heard in (*ENDS_JOB, NEW_STOP_FILE)), None
        )
        if request is None:
            return ""
        said = "the request" if isinstance(request[0], int) else "the stop file was seen"
        return f" {time.time() - request[1]:.0f} s after {said}"

    def on_step_begin(self, args, state, control, **kwargs):
        # The attempt's first step, once `trainer.train`'s own set-up is over: the engine started (DeepSpeed's, minutes
        # on a large model), the optimizer made, a resumed checkpoint loaded, the first batch read (the data loader's
        # workers started). A request made during it waited for the end of the step, trained and saved, which a
        # Slurm grace time may not leave; here every rank (the same all-reduce) ends the run before the step.
        if not self.training_begun:
            if self.stop_before_training(args.device, f"stopped before step {state.global_step + 1}"):
                raise StoppedBeforeTraining
            self.training_begun = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # One all-reduce a step for both: the main's lock lost to another run, a stop asked on any rank
        gone, lost, asked = max_of_ranks(
            [run_lock.folder_gone(), run_lock.lost() is not None, self.asked_here()], args.device
        )
        out = Path(args.output_dir) if gone or lost else None  # read only where a line names it
        if gone:  # deleted or moved away: its next save made a new folder there, and the run ended with 0 in it
            raise RunError(f"stopped: {run_lock.gone_line(out, f'after step {state.global_step}')}")
        if lost:  # every rank stops here
            raise RunError(
                f"stopped: the lock {out / run_lock.LOCK_FILE} was {run_lock.lost() or 'lost'} while this run trained "
                f"(its file removed by hand, and another run started there): this run ended after step "
                f"{state.global_step}, saving nothing in {out}, which the other run writes; it goes on from the newest "
                "checkpoint there (let it, or stop it and rerun this command)"
            )
        if asked:  # every rank stops at this step
            self.stopped = True
            control.should_save = True
            control.should_log = True  # as every saved step is (metrics.log_saved_step): a resume counts on from it
            control.should_training_stop = True
        # The last step has ended: no step is left to stop at, from its own checkpoint's save on (on_train_end comes
        # after that save, which a Ctrl-C was told would be followed by a stop, while the run went on to its end).
        self.training_over = state.global_step >= state.max_steps
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        # The evaluation that follows a step's end (its stop agreed on, in on_step_end): a request made during it (a
        # large held-out set: minutes) waited for the next step's end, which trained a step more and wrote its own
        # checkpoint, past a Slurm grace time. Now it saves at the step just evaluated. Every rank evaluates, so every
        # rank is here for the all-reduce.
        self.stop_between_steps(args, control, save=True)
        return control

    def stop_between_steps(self, args, control, save: bool) -> None:
        """A request agreed on (one all-reduce) after a step's end, before the next: stop, with a checkpoint of this
        step (`save`: none written yet). Not once the last step has ended (the run saves its final model) or after a
        stop already agreed."""
        if self.stopped or self.training_over or not self.training_begun:
            return
        if not max_over_ranks(int(self.asked_here()), args.device):
            return
        self.stopped = True
        control.should_training_stop = True
        # Only where no checkpoint of this step is written yet: set after its save, it was written again as the
        # epoch ended (the Trainer's save at an epoch's end reads the same flag)
        control.should_save = control.should_save or save

    def on_train_end(self, args, state, control, **kwargs):
        # Trained to the last step: a Ctrl-C from here finds no step to stop at, and the run goes on to save the final
        # model (publish.py). Not after a stop or a health guard's stop, which end the run without it.
        self.training_over = state.global_step >= state.max_steps
        return control

    def on_save(self, args, state, control, **kwargs):
        # Runs after the checkpoint's COMPLETE mark (this callback is registered after CompleteMarker). A request made
        # while the checkpoint was written (minutes for a 7B model) has that checkpoint: the run stops on it, where it
        # trained a step more and wrote another checkpoint, doubling the time the stop took.
        self.saved = True  # any checkpoint of this start (save_steps' too): the next start goes on from it
        self.stop_between_steps(args, control, save=False)
        if self.stopped and state.global_step < state.max_steps:
            # Every rank (the stop was agreed on), the main process writing: its refusal is every rank's line, not the
            # main's alone while the others wait in the end of training's collectives (NCCL: for ddp_timeout).
            main_outcome(
                self.mark_saved, f"checkpoint {Path(args.output_dir) / f'checkpoint-{state.global_step}'} written"
            )
        return control


@functools.cache
def _watch_forks() -> None:
    """A process forked from the run's while the run holds its SIGTERM (datasets' map workers and their Manager,
    DataLoader workers), or from one of those, ends at a SIGTERM its parent sent (`Pool.terminate`: each
    `Dataset.map(num_proc=N)`'s end stops its pool's idle workers so) and goes on at one from anywhere else (Slurm's
    SIGTERM to every process of the step, a process group's), which the run's process answers. The run's handler,
    inherited, cannot tell the two apart (Python gives it no sender), and one fate for both failed either way: a worker
    that went on waited for a task its pool, holding the queue's lock, never gives, and the run in `Pool.terminate`
    waited for it forever (about one map's end in 20); one that died at Slurm's SIGTERM could die holding that lock,
    and the run waited for it forever. So such a fork blocks SIGTERM, and a thread of its own takes it with its sender
    (`sigwaitinfo`). One hook per process, looked at each fork."""
    os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    parent, handler = os.getppid(), signal.getsignal(signal.SIGTERM)
    the_runs = isinstance(getattr(handler, "__self__", None), GracefulStop) and handler.__self__.pid == parent
    # A fork of such a fork: SIGTERM blocked as its parent's thread was
    if not the_runs and signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, ()):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # every thread started here from now on: blocked too
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # this process's end once its parent's is taken
    threading.Thread(target=_take_sigterm, args=(parent,), name="sigterm-from-parent", daemon=True).start()


def _take_sigterm(parent: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
        pass  # the run's to answer: this process ends with it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # ended by it, as by default
    os._exit(128 + signal.SIGTERM)  # one that ignores it (a DataLoader worker, `loader_worker`) ends all the same


def loader_worker(worker_id: int, then=None) -> None:
    """A DataLoader worker's start (`worker_init_fn`), then `then`'s: it ignores the stop signals, which the training
    process answers at a step's end. Slurm's preemption and `scancel` signal every process of the job step, a
    terminal's Ctrl-C its whole foreground group: a worker (the real recipes read with 4) died of the SIGTERM, and the
    training process ended at once (`DataLoader worker (pid N) is killed by signal: Terminated`), exit code 1, without
    the checkpoint the stop was to save. The worker ends with its loader, or with the training process."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


@functools.cache
def launcher_command() -> list[str] | None:
    """The command line of the launcher that started this process (its parent), read once: as the command began
    (terminal.hold_stops), else first as the stop is made (`GracefulStop`), while the launcher is there. Read at the
    stop, a launcher killed meanwhile (`LAUNCHER_GONE`) was the parent no longer, and the command printed to go on was
    init's; read once the libraries loaded, a launcher killed as they loaded was too (`started_by_accelerate`). None:
    not readable (not Linux)."""
    return terminal.parent_command_at_start() or terminal.command_of(os.getppid())


def started_by_accelerate() -> bool:
    """Whether `accelerate launch` started this one process itself (its simple launcher: one process without a process
    group, `--num_processes 1`, `--cpu`), which sets no LOCAL_RANK: its launcher `kill -9`'d, the process trained on to
    the end as an orphan holding the run's lock, as launched ranks did (`_watch_launcher`). Its parent's command line
    says so (`python .venv/bin/accelerate launch ...`, `accelerate launch ...`), in each of accelerate's spellings of
    the launch: its `accelerate-launch` console script and `python -m accelerate.commands.launch` (the GPU kit's)."""
    words = launcher_command() or []
    return any(
        Path(word).name == ACCELERATE_LAUNCH
        or (Path(word).name == "accelerate" and words[n + 1 : n + 2] == ["launch"])
        or (word == "-m" and words[n + 1 : n + 2] == ["accelerate.commands.launch"])
        for n, word in enumerate(words)
    )


def simple_launch() -> bool:
    """Whether accelerate launch's simple launcher started this process itself, its one process (`--num_processes 1`
    without a process group, `--cpu`): its parent's command line is that launch, and no LOCAL_RANK is set. Nothing in
    the environment says how many processes run (no WORLD_SIZE): one, without an engine."""
    return not launcher.under_launcher() and started_by_accelerate()


def processes_asked() -> int | None:
    """The processes the launcher's command line asked for (its `--num_processes N`, before this script's own words),
    where it gives that number; None otherwise (not an accelerate launch, not readable, not given)."""
    words = launcher_command() or []
    script = sys.argv[0] if sys.argv else None
    end = (
        words.index(script) if script in words else len(words)
    )  # the script's own options after it are not the launch's
    for n, word in enumerate(words[:end]):
        name, _, value = word.partition("=")
        if name.replace("-", "_") != "__num_processes":
            continue
        value = value or (words[n + 1] if n + 1 < end else "")
        return int(value) if value.isdigit() else None
    return None


def orphaned_at_start() -> bool:
    """Whether the one process of `accelerate launch`'s simple launcher (its environment says so,
    `launcher.simple_launch_environment`) lost its launcher before it could read its parent (terminal.hold_stops):
    killed between its fork of the process and Python's start of train_dpo.py (seconds on a busy file system), the
    launcher left the process to init, whose command line is no launcher's, so nothing watched and it trained to the end
    as an orphan holding the run's lock. Its parent then was init (pid 1), or one whose command line was already gone
    (a launcher killed as it was read), and is not its parent now (a parent's command line hidden by /proc's hidepid
    is not a death)."""
    parent = terminal.parent_at_start()
    if parent is None or not launcher.simple_launch_environment():
        return False  # imported (a program's own call), or not accelerate's one process
    return parent == 1 or (not terminal.parent_command_at_start() and os.getppid() != parent)


def rerun_command(recipe_resumes: bool = False, command: list[str] | None = None, as_typed: bool = False) -> str:
    """The command that started this run, to type again: this process's (`command` where another program called the
    run), or under a launcher (LOCAL_RANK) its parent's. Without --overwrite_output_dir (it would start afresh),
    --resume_from_checkpoint (the rerun goes on from the newest verified checkpoint) and secrets. A recipe file's
    resume_from_checkpoint (`recipe_resumes`) is cleared with `--resume_from_checkpoint ''`: without it, the rerun
    went back to that checkpoint, and was refused as the run's own checkpoints are past it. `as_typed` (a run stopped
    before it replaced the old run, which is still there to replace): without secrets only."""
    words = command or [sys.executable, *sys.argv]
    if launcher.under_launcher() or started_by_accelerate():
        words = launcher_command()
        if words is None:  # not Linux: the launcher's command line is not readable
            return "the same `accelerate launch ...` command"
        if len(words) > 1 and Path(words[1]).name in ("accelerate", ACCELERATE_LAUNCH, "torchrun"):
            words = words[1:]  # `python .venv/bin/accelerate launch ...` as the user typed it: `accelerate launch ...`
    kept, after = [], None  # after: the dropped flag whose value may come next
    for word in without_secrets(words):
        takes_value = after == "--resume_from_checkpoint" or (after and word.lower() in TRUE + FALSE)
        after = None
        if takes_value:
            continue
        flag, equals, _ = word.partition("=")
        flag = "--" + flag[2:].replace("-", "_") if flag.startswith("--") else flag  # `--overwrite-output-dir` too
        if flag in ("--overwrite_output_dir", "--resume_from_checkpoint") and not as_typed:
            after = None if equals else flag
            continue
        kept.append(word)
    return shlex.join(kept + (["--resume_from_checkpoint", ""] if recipe_resumes and not as_typed else []))


def check_stop_file(path: Path) -> None:
    """The stop file's folder must take `<stop file>.checkpointed`, or the job fails after a checkpoint, unrequeued."""
    problem = unwritable(path.parent) if path.parent.exists() else (path.parent, os.strerror(errno.ENOENT))
    if problem:
        raise ConfigError(
            f"{STOP_FILE_ENV}={path}: cannot write in {problem[0]} ({problem[1]}), so a stop could not be confirmed "
            f"and the job would not requeue: point {STOP_FILE_ENV} to a writable folder every node sees "
            "(scripts/launch.sh: the project's logs/, or a DPOTRAIN_STOP_FILE given, its %j the job id)"
        )
